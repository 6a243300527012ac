"""The one training loop (fastweights.training.loop): accumulation over micro-batches, the stop at a step boundary
and an exact resume, the steps at which the evaluation, save and record hooks fire."""

import contextlib
import os
import signal

import pytest
import torch
from torch import nn

from fastweights.training import loop as training_loop
from fastweights.training.control import Interrupted, stop_on_signals
from fastweights.training.step import adamw, lr_factor
from tests.tolerances import EXACT_F64, WEIGHTS_MOVED

N, D = 8, 4  # examples per step, features


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (x [N, D], y [N]) float64 batch per step (a function of the step: a resumed run reads the same)."""
    return [(torch.randn(N, D, dtype=torch.float64), torch.randn(N, dtype=torch.float64)) for _ in range(steps)]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _opt(model: nn.Module, steps: int):
    opt = adamw(model, lr=0.05, betas=(0.9, 0.99), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total=steps, warmup=2, floor=0.1))
    return opt, sched


def _hooks(model, data, accum: int, log: list, **kw) -> training_loop.Hooks:
    """Step s: data[s] split into `accum` micro-batches; each micro-batch's loss is its summed squared error over
    the step's N examples (so the micro-batches' gradients add up to the whole batch's mean)."""

    def batches(s):
        x, y = data[s]
        return list(zip(x.chunk(accum), y.chunk(accum)))

    def loss(b):
        x, y = b
        return ((model(x).squeeze(-1) - y) ** 2).sum() / N

    def record(step, losses, lr):
        log.append(("record", step, sum(losses), lr, len(losses)))

    return training_loop.Hooks(batches=batches, loss=loss, record=record, grad_clip=1.0, **kw)


def test_two_micro_batches_take_the_steps_one_batch_takes():
    """float64: grad accumulation over 2 micro-batches gives every step's loss and lr, and the final weights, of one
    batch of both (one optimizer step per step, the gradients of both micro-batches summed)."""
    steps, seed = 5, int(torch.randint(0, 2**31, ()).item())
    data = _data(steps)
    runs = {}
    for accum in (1, 2):
        model = _model(seed)
        opt, sched = _opt(model, steps)
        log = []
        assert training_loop.run(_hooks(model, data, accum, log), model, opt, sched, 0, steps) == steps
        runs[accum] = model, log
    (one, log1), (two, log2) = runs[1], runs[2]
    ref, ref_log = _reference(seed, data, steps)
    assert [r[1:] for r in log1] == ref_log  # one micro-batch: the plain step, bit for bit
    assert all(torch.equal(p, q) for p, q in zip(one.parameters(), ref.parameters()))
    assert [r[1] for r in log2] == list(range(1, steps + 1)) and {r[4] for r in log2} == {2}
    for a, b in zip(log1, log2):
        assert a[1] == b[1] and a[3] == b[3]  # the step, the lr it used
        assert abs(a[2] - b[2]) < EXACT_F64 * max(1.0, abs(a[2])), (a, b)
    for p, q, p0 in zip(one.parameters(), two.parameters(), _model(seed).parameters()):
        assert (p - q).abs().max() < EXACT_F64
        assert (p - p0).abs().max() > WEIGHTS_MOVED  # (the weights moved)


def _reference(seed: int, data, steps: int):
    """The plain loop over whole batches: loss, backward, clip, AdamW step, clear, schedule; (model, [(step, loss,
    lr, 1)])."""
    model = _model(seed)
    opt, sched = _opt(model, steps)
    log = []
    for s in range(steps):
        x, y = data[s]
        loss = ((model(x).squeeze(-1) - y) ** 2).sum() / N
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.append((s + 1, 0 + loss.item(), sched.get_last_lr()[0], 1))
        sched.step()
    return model, log


def test_micro_batches_but_the_last_skip_the_gradient_sync():
    """`accumulate` enters the model's no_sync for every micro-batch but the last (DDP / FSDP2 sync once)."""
    model = _model(0)
    opt, sched = _opt(model, 3)
    entered = []

    @contextlib.contextmanager
    def no_sync():
        entered.append(len(log))
        yield

    model.no_sync = no_sync
    log = []
    training_loop.run(_hooks(model, _data(2), 4, log), model, opt, sched, 0, 2)
    assert entered == [0, 0, 0, 1, 1, 1]


def test_a_stop_at_step_k_saves_there_and_the_resume_reaches_the_uninterrupted_weights(tmp_path):
    """A SIGINT during step k (under `stop_on_signals`: the loop marks itself as training, so the signal only
    requests a stop) is seen at the boundary before step k + 1: interrupt(k) saves; a new run resumed from that
    save ends with the weights of a run never stopped, bit for bit."""
    steps, k = 7, int(torch.randint(2, 6, ()).item())
    data = _data(steps)
    seed = int(torch.randint(0, 2**31, ()).item())

    ref = _model(seed)
    opt, sched = _opt(ref, steps)
    training_loop.run(_hooks(ref, data, 2, []), ref, opt, sched, 0, steps)

    model = _model(seed)
    opt, sched = _opt(model, steps)
    log, stops = [], []
    ckpt = tmp_path / "ckpt.pt"

    def record(step, losses, lr):
        log.append(step)
        if step == k:
            os.kill(os.getpid(), signal.SIGINT)

    def interrupt(s):
        stops.append(s)
        torch.save({"step": s, "model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                   ckpt)
        raise Interrupted(f"stopped at {s}")

    hooks = _hooks(model, data, 2, [], interrupt=interrupt)
    hooks.record = record
    with stop_on_signals(), pytest.raises(Interrupted, match=f"stopped at {k}"):
        training_loop.run(hooks, model, opt, sched, 0, steps)
    assert stops == [k] and log == list(range(1, k + 1))

    st = torch.load(ckpt, weights_only=False)
    again = _model(seed + 1)  # (other initial weights: the checkpoint must set them)
    opt, sched = _opt(again, steps)
    again.load_state_dict(st["model"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    rest = []
    assert training_loop.run(_hooks(again, data, 2, rest), again, opt, sched, st["step"], steps) == steps
    assert [r[1] for r in rest] == list(range(k + 1, steps + 1))
    for p, q in zip(ref.parameters(), again.parameters()):
        assert torch.equal(p, q)


def test_evaluate_and_save_fire_every_n_steps_and_after_the_last():
    """eval_every 3, save_every 2 over 7 steps: evaluate at 3, 6, 7 and save at 2, 4, 6, 7 (evaluate first), each
    after that step's record; evaluate returning False ends the run after that step's save."""
    model = _model(0)
    events = []

    def hooks(**kw):
        h = _hooks(model, _data(7), 1, events, eval_every=3, save_every=2,
                   save=lambda step: events.append(("save", step)), **kw)
        return h

    opt, sched = _opt(model, 7)
    h = hooks(evaluate=lambda step: events.append(("eval", step)))
    assert training_loop.run(h, model, opt, sched, 0, 7) == 7
    assert [e[:2] for e in events] == [
        ("record", 1), ("record", 2), ("save", 2), ("record", 3), ("eval", 3), ("record", 4), ("save", 4),
        ("record", 5), ("record", 6), ("eval", 6), ("save", 6), ("record", 7), ("eval", 7), ("save", 7)]

    events.clear()
    h = hooks(evaluate=lambda step: events.append(("eval", step)) or step < 6)
    assert training_loop.run(h, model, opt, sched, 2, 7) == 6  # (resumed at 2: the counts are of the step)
    assert [e[:2] for e in events] == [("record", 3), ("eval", 3), ("record", 4), ("save", 4), ("record", 5),
                                       ("record", 6), ("eval", 6), ("save", 6)]


def test_a_record_returning_false_ends_the_run_and_a_step_hook_replaces_the_optimizer_step():
    """record → False ends the run after that step (no evaluate or save for it); `step` stands in for the
    accumulation and the optimizer step (the weights stay where the hook leaves them)."""
    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    opt, sched = _opt(model, 5)
    seen = []
    h = training_loop.Hooks(batches=lambda s: [s], step=lambda s, micro: (seen.append(micro) or [float(s)], 0.5),
                            record=lambda step, losses, lr: step < 3, evaluate=lambda step: seen.append("eval"),
                            eval_every=3, save=lambda step: seen.append("save"), save_every=3)
    assert training_loop.run(h, model, opt, sched, 0, 5) == 3
    assert seen == [[0], [1], [2]]
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
