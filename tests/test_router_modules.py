"""HeadRouter (Elastic) and LayerRouter (Flux): sizes, shapes, per-sequence routing, configs and bad input."""

import pytest
import torch

from flexsparse.routers import HeadRouter, LayerRouter, Router, Routing, boundary_pool


def count(module):
    return sum(p.numel() for p in module.parameters())


def test_parameter_counts_match_the_papers():
    assert count(HeadRouter(128)) == 263_682  # Elastic: "0.27M"
    assert count(LayerRouter(128)) == 592_002  # Flux's code widths


def test_head_router_shapes_and_modes():
    router = HeadRouter(16, pool_size=4, full_mode=2, sparse_mode=0).eval()
    keys = torch.randn(3, 20, 5, 16)
    logits = router(keys)
    assert logits.shape == (3, 5, 2)
    routing = router.route(keys)
    modes = routing.modes()
    assert modes.shape == (3, 5) and modes.dtype == torch.long
    expected = torch.where(logits[..., 1] > logits[..., 0], 0, 2)
    assert torch.equal(modes, expected)
    assert torch.equal(routing.modes(5), modes)


def test_head_router_follows_its_definition():
    """logits = router_mlp(task_mlp(boundary_pool(k))), the same weights for every head."""
    router = HeadRouter(8, pool_size=3)
    keys = torch.randn(2, 11, 4, 8)
    pooled = boundary_pool(keys, pool_size=3)
    d = 8
    x = pooled
    for name, widths in (("task_mlp", [d, 4 * d, d]), ("router_mlp", [d, 4 * d, d, 2])):
        linears = [m for m in getattr(router, name) if isinstance(m, torch.nn.Linear)]
        assert [(m.in_features, m.out_features) for m in linears] == list(zip(widths[:-1], widths[1:]))
        for i, m in enumerate(linears):
            x = m(x)
            if i < len(linears) - 1:
                x = torch.nn.functional.silu(x)
    torch.testing.assert_close(router(keys), x)
    permuted = keys[:, :, [2, 0, 3, 1]]
    torch.testing.assert_close(router(permuted), router(keys)[:, [2, 0, 3, 1]])


def test_layer_router_shapes_and_head_average():
    router = LayerRouter(8, pool_size=3).eval()
    queries = torch.randn(2, 11, 6, 8)
    logits = router(queries)
    assert logits.shape == (2, 2)
    torch.testing.assert_close(router(queries[:, :, torch.randperm(6)]), logits, atol=1e-6, rtol=1e-6)
    head_mean = boundary_pool(queries, pool_size=3).mean(1)
    torch.testing.assert_close(logits, router.router_mlp(router.task_mlp(head_mean)))
    routing = router.route(queries)
    assert routing.weights.shape == (2, 1, 2)
    modes = routing.modes(4)
    assert modes.shape == (2, 4) and (modes == modes[:, :1]).all()


@pytest.mark.parametrize("cls,heads", [(HeadRouter, 3), (LayerRouter, 6)])
def test_batch_elements_are_routed_independently(cls, heads):
    """A sequence's logits do not depend on the rest of the batch, nor on its padding."""
    router = cls(8, pool_size=4)
    short, long_ = torch.randn(1, 7, heads, 8), torch.randn(1, 15, heads, 8)
    batch = torch.cat([torch.cat([torch.randn(1, 8, heads, 8), short], 1), long_])  # row 0 left-padded
    mask = torch.ones(2, 15, dtype=torch.bool)
    mask[0, :8] = False
    logits = router(batch, mask)
    torch.testing.assert_close(logits[0], router(short)[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logits[1], router(long_)[0], atol=1e-6, rtol=1e-6)
    other = batch.clone()
    other[1] = torch.randn(15, heads, 8)
    assert torch.equal(router(other, mask)[0], logits[0])
    assert not torch.allclose(router(other, mask)[1], logits[1])


def test_inference_is_deterministic_and_training_samples():
    router = HeadRouter(8, pool_size=4)
    keys = torch.randn(4, 9, 3, 8)
    router.eval()
    first, second = router.route(keys), router.route(keys)
    assert torch.equal(first.weights, second.weights) and not first.weights.requires_grad
    router.train()
    sampled = [router.route(keys, tau=1.0, generator=torch.Generator().manual_seed(s)).weights for s in range(2)]
    again = router.route(keys, tau=1.0, generator=torch.Generator().manual_seed(0)).weights
    assert torch.equal(sampled[0], again)
    assert sampled[0].requires_grad and set(sampled[0].unique().tolist()) <= {0.0, 1.0}
    soft = router.route(keys, hard=False, generator=torch.Generator().manual_seed(0))
    assert ((soft.weights > 0) & (soft.weights < 1)).all()


def test_gradient_reaches_every_parameter():
    router = HeadRouter(8, pool_size=4)
    routing = router.route(torch.randn(4, 9, 3, 8), tau=1.5, generator=torch.Generator().manual_seed(0))
    (routing.sparse_weight * torch.randn(4, 3)).sum().backward()
    for name, p in router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls", [HeadRouter, LayerRouter])
def test_config_round_trip(cls):
    router = cls(16, pool_size=7, full_mode=1, sparse_mode=3, init_std=0.05)
    config = router.config()
    assert config == {"kind": cls.kind, "head_dim": 16, "pool_size": 7, "full_mode": 1, "sparse_mode": 3,
                      "init_std": 0.05}
    rebuilt = Router.from_config(config)
    assert type(rebuilt) is cls
    rebuilt.load_state_dict(router.state_dict())
    states = torch.randn(2, 10, 4, 16)
    assert torch.equal(rebuilt(states), router(states))


def test_initialisation():
    router = HeadRouter(128)
    linears = [m for m in router.modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.equal(m.bias, torch.zeros_like(m.bias)) for m in linears)
    weights = torch.cat([m.weight.flatten() for m in linears])
    assert abs(weights.std().item() - 0.02) < 0.001
    logits = router.eval()(torch.randn(2, 300, 8, 128))
    assert logits.abs().max() < 0.1  # both modes start equally likely


def test_routing_modes_checks_heads():
    routing = Routing(torch.zeros(2, 3, 2), torch.tensor([[[1.0, 0.0]] * 3] * 2), 0, 1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        routing.modes(4)


def test_bad_input():
    router = HeadRouter(8)
    with pytest.raises(ValueError, match="key_states has head_dim 16"):
        router(torch.randn(1, 5, 2, 16))
    with pytest.raises(ValueError, match="key_states must be 4-D"):
        router(torch.randn(5, 2, 8))
    with pytest.raises(ValueError, match="query_states has head_dim"):
        LayerRouter(8)(torch.randn(1, 5, 2, 4))
    with pytest.raises(ValueError, match="pool_size"):
        HeadRouter(8, pool_size=0)
    with pytest.raises(ValueError, match="head_dim"):
        LayerRouter(0)
    with pytest.raises(ValueError, match="full_mode and sparse_mode"):
        HeadRouter(8, full_mode=1, sparse_mode=1)
    with pytest.raises(ValueError, match="sparse_mode"):
        HeadRouter(8, sparse_mode=-1)
    with pytest.raises(ValueError, match="kind"):
        Router.from_config({"kind": "mystery", "head_dim": 8})
    with pytest.raises(ValueError, match=r"keys \['width'\]"):
        Router.from_config({"kind": "head", "head_dim": 8, "width": 3})
    with pytest.raises(ValueError, match="key_padding_mask"):
        router(torch.randn(1, 5, 2, 8), torch.ones(1, 4, dtype=torch.bool))
