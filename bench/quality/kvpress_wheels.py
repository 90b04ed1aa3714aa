"""The wheels kvpress's environment needs on a machine without internet (used by ``kvpress_env.sh``).

    python kvpress_wheels.py pins FILE REQUIREMENT...   # run by the built venv's Python: the closure of the
                                                       # requirements, pinned to its installed versions, no torch
    python kvpress_wheels.py parts DIR MIB ALL NAME...  # DIR/all/*.whl -> DIR/part-K (<= MIB MiB each): the
                                                       # NAMEs' wheels first; ALL=1: the others too, else dropped
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

SKIP = {"torch"}  # the GPU machine keeps its own torch; what only torch needs comes with it


def key(name: str) -> str:
    """A package name as pip compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path, requirements: list[str]) -> dict[str, str]:
    """Installed versions of the requirements and of everything they need (extras followed), less torch."""
    from packaging.requirements import Requirement

    wanted: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    queue = [Requirement(spec) for spec in requirements]
    while queue:
        requirement = queue.pop()
        name, extras = key(requirement.name), {""} | set(requirement.extras)
        if name in SKIP or {(name, extra) for extra in extras} <= seen:
            continue
        seen |= {(name, extra) for extra in extras}
        dist = distribution(requirement.name)
        wanted[name] = dist.version
        for line in dist.requires or []:
            child = Requirement(line)
            if child.marker is not None and not any(child.marker.evaluate({"extra": e}) for e in extras):
                continue
            try:
                distribution(child.name)
            except PackageNotFoundError:
                continue  # an optional requirement this venv does not have
            queue.append(child)
    path.write_text("".join(f"{name}=={version}\n" for name, version in sorted(wanted.items())))
    return wanted


def pack(wheels: list[Path], limit: int) -> list[tuple[int, list[Path]]]:
    """First fit of the wheels, largest first, into parts of at most ``limit`` bytes."""
    parts: list[list] = []
    for wheel in sorted(wheels, key=lambda p: -p.stat().st_size):
        size = wheel.stat().st_size
        if size > limit:
            raise SystemExit(f"error: {wheel.name} alone is {size / 2**20:.1f} MiB, over {limit / 2**20:.0f} MiB")
        for part in parts:
            if part[0] + size <= limit:
                part[0] += size
                part[1].append(wheel)
                break
        else:
            parts.append([size, [wheel]])
    return [(size, files) for size, files in parts]


def parts(root: Path, mib: int, everything: bool, first_names: list[str]) -> None:
    """Move DIR/all's wheels into DIR/part-K folders and print them with their sizes."""
    first_keys = {key(name) for name in first_names}
    wheels = list((root / "all").glob("*.whl"))
    first = [w for w in wheels if key(w.name.split("-")[0]) in first_keys]
    rest = [w for w in wheels if w not in first]
    limit = mib * 2**20
    found = pack(first, limit) + (pack(rest, limit) if everything else [])
    for index, (size, files) in enumerate(found, 1):
        folder = root / f"part-{index}"
        folder.mkdir(exist_ok=True)
        print(f"{folder}: {size / 2**20:.1f} MiB")
        for wheel in sorted(files, key=lambda p: p.name):
            print(f"  {wheel.name}  {wheel.stat().st_size / 2**20:.2f} MiB")
            wheel.rename(folder / wheel.name)
    for leftover in (root / "all").iterdir():
        leftover.unlink()
    (root / "all").rmdir()
    total = sum(size for size, _ in found)
    print(f"{len(found)} part(s), {total / 2**20:.1f} MiB; carry {root}/part-K, then there: "
          f"bash bench/quality/kvpress_env.sh --from-wheels {root}")


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "pins":
        pins(Path(argv[1]), argv[2:])
        return 0
    if len(argv) >= 4 and argv[0] == "parts" and argv[3] in ("0", "1") and argv[2].isdigit():
        parts(Path(argv[1]), int(argv[2]), argv[3] == "1", argv[4:])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
