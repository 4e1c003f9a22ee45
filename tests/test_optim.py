"""training/optim.py piece by piece, where the rest of the suite (schedules against transformers',
AdamW and Muon against torch's, in tests/test_training_core.py) left behaviour unpinned: found by
mutation testing of optim.py, each test fails on a mutant the suite let pass."""
import math

import pytest
import torch

from training.config import load_config
from training.optim import (AdamW, Muon, _orthogonalised_by_share, build_optimizer, lr_at, newton_schulz,
                            set_lr, split_params)


def _params(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(6, 5, generator=g) * scale),
            torch.nn.Parameter(torch.randn(5, generator=g) * scale)]


def _grads(ps, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale


# -- lr_at -------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_schedule_stays_at_its_floor_past_the_last_step(schedule):
    """Defensive: read past max_steps - 1 the rate stays at min_lr_ratio x peak (the cosine does
    not climb back up)."""
    floor = lr_at(99, 100, 1.0, 10, 0.1, schedule)
    assert floor == pytest.approx(0.1)
    for s in (99.5, 100, 120, 150, 199):
        assert lr_at(s, 100, 1.0, 10, 0.1, schedule) == pytest.approx(floor), s


# -- split_params --------------------------------------------------------------------------------

def test_frozen_parameters_are_in_no_group():
    """split_params takes trainable parameters only."""
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    m[1].weight.requires_grad_(False)
    m[2].bias.requires_grad_(False)
    matrices, embeds, vectors = split_params(m)
    got = {id(p) for p in matrices + embeds + vectors}
    assert got == {id(p) for p in m.parameters() if p.requires_grad}
    assert [id(p) for p in matrices] == [id(m[2].weight)]
    assert [id(p) for p in vectors] == [id(m[1].bias)]


# -- AdamW ---------------------------------------------------------------------------------------

def test_adamw_matches_torch_where_eps_matters():
    """Gradients ~1e-6: eps (1e-8) is added to sqrt(v_hat), as torch does, not inside the root."""
    a, b = _params(), _params()
    ours = AdamW(a, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    for step in range(4):
        _grads(a, step, 1e-6), _grads(b, step, 1e-6)
        ours.step(), ref.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


MAKERS = {
    "adamw": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1),
    "muon": lambda ps: Muon([{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False}],
                            lr=1e-2, weight_decay=0.1),
    "muon_fused": lambda ps: Muon([{"params": ps[:1], "use_muon": True}, {"params": ps[1:], "use_muon": False}],
                                  lr=1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize("make", list(MAKERS))
def test_found_inf_on_the_very_first_step_is_a_no_op(make):
    """An overflow at step 1 (GradScaler's first steps): nothing moves, nothing becomes NaN, and
    the next step is Adam's first step (bias correction from t=1)."""
    ps, ref = _params(), _params()
    opt = MAKERS[make](ps)
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    for p, q in zip(ps, ref):
        assert torch.equal(p, q)
    opt.found_inf = torch.zeros(())
    _grads(ps, 0)
    opt.step()
    assert all(torch.isfinite(p).all() for p in ps)
    ref_opt = MAKERS[make](ref)
    _grads(ref, 0)
    ref_opt.step()
    for p, q in zip(ps, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", list(MAKERS))
def test_parameters_without_gradients_are_left_alone(make):
    """A parameter that got no gradient (unused this step) is skipped, not a crash; the others step
    as without it."""
    ps = _params() + [torch.nn.Parameter(torch.ones(4, 3)), torch.nn.Parameter(torch.ones(3))]
    ref = _params()
    groups = lambda ps: [ps[0], ps[1]] if len(ps) == 2 else [ps[0], ps[2], ps[1], ps[3]]  # noqa: E731
    if make == "adamw":
        opt = AdamW(groups(ps), lr=1e-2, weight_decay=0.1)
    else:
        opt = Muon([{"params": [ps[0], ps[2]], "use_muon": True}, {"params": [ps[1], ps[3]], "use_muon": False}],
                   lr=1e-2, weight_decay=0.1, fused=make == "muon_fused")
    ref_opt = MAKERS[make](ref)
    for step in range(2):
        _grads(ps[:2], step), _grads(ref, step)
        opt.step(), ref_opt.step()
    assert torch.equal(ps[2], torch.ones(4, 3)) and torch.equal(ps[3], torch.ones(3))
    for p, q in zip(ps[:2], ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_cpu_step_count_moves_to_the_parameters_device():
    """A checkpoint's step (kept on the CPU by load_state_dict) goes to the parameter's device
    (meta standing in for a GPU), fp32, when the state is used."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    saved = AdamW([p], lr=1e-3)
    saved.step()
    q = torch.nn.Parameter(torch.ones(3, device="meta"))
    mine = AdamW([q], lr=1e-3)
    mine.load_state_dict(saved.state_dict())
    assert mine.state[q]["step"].device.type == "cpu"
    mine.init_state()
    assert mine.state[q]["step"].device.type == "meta" and mine.state[q]["step"].dtype == torch.float32


# -- spread over DDP replicas ---------------------------------------------------------------------

@pytest.mark.parametrize("count,world", [(4, 2), (6, 3), (3, 2), (5, 4), (1, 2)])
def test_each_replica_orthogonalises_an_even_share(monkeypatch, count, world):
    """Simulated ranks: each computes at most ceil(count / world) matrices, the shares tile the
    stack without overlap, and the gathered result is newton_schulz of the stack."""
    import torch.distributed as dist

    import training.optim as optim
    torch.manual_seed(0)
    m = torch.randn(count, 6, 4)
    want = newton_schulz(m)
    computed, sent = {}, {}
    real_ns = optim.newton_schulz
    for rank in range(world):
        monkeypatch.setattr(dist, "get_world_size", lambda group: world)
        monkeypatch.setattr(dist, "get_rank", lambda group, r=rank: r)
        monkeypatch.setattr(optim, "newton_schulz",
                            lambda x, steps, r=rank: computed.setdefault(r, x.clone()) is not None and real_ns(x, steps))
        monkeypatch.setattr(dist, "all_gather_into_tensor",
                            lambda out, mine, group, r=rank: sent.setdefault(r, mine.clone()))
        _orthogonalised_by_share(m, 5, None)
    share = -(-count // world)
    assert all(x.shape[0] <= share for x in computed.values()), {r: x.shape[0] for r, x in computed.items()}
    assert sum(x.shape[0] for x in computed.values()) == count
    assert torch.equal(torch.cat([computed[r] for r in range(world) if r in computed]), m)
    assert len({x.shape for x in sent.values()}) == 1
    gathered = torch.cat([sent[r] for r in range(world)])[:count]
    torch.testing.assert_close(gathered, want, rtol=1e-6, atol=1e-7)


# -- build_optimizer / set_lr --------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_set_lr_scales_every_group_from_its_own_peak(optimizer):
    """Muon's matrices from muon_lr, its AdamW group from learning_rate, each x the factor."""
    cfg = load_config(None, ["training.max_steps=1", f"training.optimizer={optimizer}",
                             "training.learning_rate=0.004", "training.muon_lr=0.03"]).training
    opt = build_optimizer(torch.nn.Linear(4, 3), cfg)
    peaks = (0.03, 0.004) if optimizer == "muon" else (0.004, 0.004)
    assert tuple(g["lr"] for g in opt.param_groups) == peaks
    for factor in (0.5, 0.1):
        set_lr(opt, factor)
        for g, peak in zip(opt.param_groups, peaks):
            assert g["lr"] == pytest.approx(peak * factor)


def test_set_lr_of_zero_is_a_tiny_distinct_nonzero_rate():
    """factor 0 is set as 1e-30 x each peak: nonzero, and the groups' rates still distinct."""
    cfg = load_config(None, ["training.max_steps=1", "training.optimizer=muon",
                             "training.learning_rate=0.004", "training.muon_lr=0.03"]).training
    opt = build_optimizer(torch.nn.Linear(4, 3), cfg)
    set_lr(opt, 0.0)
    lrs = [g["lr"] for g in opt.param_groups]
    assert all(0 < lr < 1e-28 for lr in lrs) and lrs[0] != lrs[1]
    assert lrs == pytest.approx([0.03e-30, 0.004e-30])


def test_set_lr_fills_a_tensor_rate_in_place():
    """A group whose lr is a tensor (a compiled/XLA graph input) keeps that tensor."""
    p = torch.nn.Parameter(torch.ones(3, 2))
    opt = AdamW([p], lr=1e-3)
    lr = torch.tensor(2e-3)
    opt.param_groups[0]["lr"] = lr
    opt.param_groups[0]["base_lr"] = 2e-3
    set_lr(opt, 0.25)
    assert opt.param_groups[0]["lr"] is lr
    assert lr.item() == pytest.approx(5e-4)
    assert not math.isnan(lr.item())
