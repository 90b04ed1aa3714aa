"""Experiments that use flexsparse (not part of the installed package); tests import them as ``examples.*``."""
