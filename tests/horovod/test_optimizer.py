"""DistributedOptimizer: two real ranks train a plain model to the weights one process
reaches on the whole batch; its checks and Horovod's usage patterns."""

import warnings

import numpy as np
import pytest
import torch
from torch.nn.functional import mse_loss

import spark_estimator.horovod as hvd
from spark_estimator import run

STEPS = 4
ROWS = 8  # split in two halves, one per rank


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 3, generator=g), torch.randn(ROWS, 1, generator=g)


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)


def reference(lr=0.1, clip=None, scheduler=False):
    """The weights one process reaches on the whole batch."""
    x, y = data()
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
    for _ in range(STEPS):
        opt.zero_grad()
        mse_loss(net(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if steplr:
            steplr.step()
    return net.state_dict()


def combine(a, b):
    """Adasum of two vectors (numpy reference)."""
    dot = a @ b
    return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b


def distributed_training():
    import warnings

    import torch
    from torch.nn.functional import mse_loss

    import spark_estimator.horovod as hvd

    hvd.init()
    r = hvd.rank()
    x, y = data()
    half = ROWS // hvd.size()
    x, y = x[r * half : (r + 1) * half], y[r * half : (r + 1) * half]
    out = {}

    def wrapped(lr=0.1, **kwargs):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        return net, hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(), **kwargs)

    def train(net, opt, steps=STEPS):
        for _ in range(steps):
            opt.zero_grad()
            mse_loss(net(x), y).backward()
            opt.step()
        return net.state_dict()

    net, opt = wrapped()
    out["class"] = (isinstance(opt, torch.optim.SGD), type(opt).__name__)
    out["sgd"] = train(net, opt)

    def counted(net, opt):
        """The weights ``train`` reaches, and rank 0's count of gradient allreduces."""
        import json
        import os
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "timeline.json")
        hvd.start_timeline(path)
        weights = train(net, opt)
        hvd.stop_timeline()
        if r != 0:
            return weights, None
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        return weights, sum(e["name"].startswith("allreduce (in flight)") for e in events)

    out["fused"] = counted(*wrapped())
    out["groups=2"] = counted(*wrapped(groups=2))
    out["num_groups=2"] = counted(*wrapped(num_groups=2, sparse_as_dense=True))
    net = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        named_parameters=net.named_parameters(),
        groups=[[net.bias]],
    )
    out["groups listed"] = counted(net, opt)
    out["fp16"] = train(*wrapped(compression=hvd.Compression.fp16))
    out["predivide"] = train(*wrapped(gradient_predivide_factor=2.0))
    out["sum"] = train(*wrapped(op=hvd.Sum))  # the ranks' gradients added: lr 0.1 acts as 0.2

    net, opt = wrapped(backward_passes_per_step=2)
    for _ in range(STEPS):
        opt.zero_grad()
        for part in (slice(0, half // 2), slice(half // 2, half)):
            (mse_loss(net(x[part]), y[part]) / 2).backward()
        opt.step()
    out["two passes"] = net.state_dict()
    net, opt = wrapped()
    opt.set_backward_passes_per_step(3)  # Horovod's setter: 3 passes from now on
    for _ in range(STEPS):
        opt.zero_grad()
        for part in (
            slice(0, half // 3),
            slice(half // 3, 2 * half // 3),
            slice(2 * half // 3, half),
        ):
            (mse_loss(net(x[part]), y[part]) * (part.stop - part.start) / half).backward()
        opt.step()
    out["three passes set"] = net.state_dict()

    net, opt = wrapped(lr=0.05 * hvd.size())
    steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            opt.zero_grad()
            mse_loss(net(x), y).backward()
            opt.step()
            steplr.step()
    out["scheduler"] = net.state_dict()
    out["scheduler lr"] = steplr.get_last_lr()
    out["scheduler warnings"] = [str(w.message) for w in caught]

    net, opt = wrapped()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            opt.zero_grad()
            mse_loss(net(x), y).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
    out["clipped"] = {k: v.clone() for k, v in net.state_dict().items()}
    out["skip warnings"] = [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.zero_grad()
        mse_loss(net(x), y).backward()
        opt.synchronize()
        opt.step()  # synchronizes again: Horovod warns
    out["step after synchronize"] = [str(w.message) for w in caught]

    errors = {}
    net, opt = wrapped()
    opt.zero_grad()
    mse_loss(net(x), y).backward()
    try:
        opt.zero_grad()
    except RuntimeError as e:
        errors["zero_grad"] = str(e)
    try:
        mse_loss(net(x), y).backward()
    except RuntimeError as e:
        errors["passes"] = str(e)
    opt.synchronize()  # finish the reductions in flight
    opt.zero_grad()
    out["errors"] = errors

    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), op=hvd.Adasum)
    opt.zero_grad()
    mse_loss(net(x), y).backward()
    out["adasum grads"] = [p.grad.clone() for p in net.parameters()]
    opt.step()
    out["adasum"] = [p.detach().clone() for p in net.parameters()]
    return out


def close(a, b, tol):
    return all(torch.allclose(a[k], b[k], atol=tol, rtol=0) for k in b)


def test_two_ranks_train_to_the_weights_of_one_process_on_the_whole_batch(spark):
    results = run(distributed_training, num_proc=2, use_gpu=False, spark=spark)
    whole = reference()
    for out in results:
        assert out["class"] == (True, "SGD")
        assert close(out["sgd"], whole, 1e-6)
        # groups: the same training, in one fused allreduce a step or one per group
        allreduces = {}
        for case in ("fused", "groups=2", "num_groups=2", "groups listed"):
            weights, allreduces[case] = out[case]
            assert close(weights, whole, 1e-6), case
        if out is results[0]:
            assert allreduces == {
                "fused": STEPS,
                "groups=2": 2 * STEPS,
                "num_groups=2": 2 * STEPS,
                "groups listed": 2 * STEPS,  # the bias, and the weight on its own
            }
        assert close(out["predivide"], whole, 1e-6)
        assert close(out["two passes"], whole, 1e-6)
        assert close(out["three passes set"], whole, 1e-6)
        assert close(out["sum"], reference(lr=0.2), 1e-6)
        assert close(out["fp16"], whole, 1e-3)
        assert not close(out["fp16"], whole, 1e-7)  # the gradients travelled as float16
        assert close(out["scheduler"], reference(lr=0.1, scheduler=True), 1e-6)
        assert out["scheduler lr"] == [0.025]
        assert out["scheduler warnings"] == []
        assert close(out["clipped"], reference(clip=0.05), 1e-6)
        assert not close(out["clipped"], whole, 1e-3)  # the clipping mattered
        assert out["skip warnings"] == []
        assert any("after optimizer.synchronize()" in m for m in out["step after synchronize"])
        assert "before optimizer.step() or optimizer.synchronize()" in out["errors"]["zero_grad"]
        assert "was computed more than backward_passes_per_step=1" in (out["errors"]["passes"])
    # Adasum combines the ranks' updates (-lr * gradient), tensor by tensor
    start = [p.detach() for p in model().parameters()]
    for i, w in enumerate(start):
        deltas = [-0.1 * out["adasum grads"][i].double().numpy().ravel() for out in results]
        expected = w.double().numpy().ravel() + combine(*deltas)
        for out in results:
            assert np.allclose(out["adasum"][i].numpy().ravel(), expected, atol=1e-6)


def test_the_wrapped_optimizer_is_the_users_class_with_its_state(one_rank):
    hvd.init()
    net = model()
    base = torch.optim.Adam(net.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(base, named_parameters=net.named_parameters())
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups is base.param_groups
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    x, y = data()
    for _ in range(2):  # one process: the optimizer's own steps
        opt.zero_grad()
        mse_loss(net(x), y).backward()
        opt.step()
        opt.load_state_dict(opt.state_dict())  # re-patches the class's step: hooks still once
    assert len(calls) == 2
    plain = model()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    for _ in range(2):
        plain_opt.zero_grad()
        mse_loss(plain(x), y).backward()
        plain_opt.step()
    assert close(net.state_dict(), plain.state_dict(), 0)


def test_bad_arguments_are_refused_naming_them(one_rank):
    hvd.init()
    net = model()

    def wrap(**kwargs):
        return hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)

    named = list(net.named_parameters())
    with pytest.raises(ValueError, match=r"named_parameters: names must be unique.*'w'"):
        wrap(named_parameters=[("w", named[0][1]), ("w", named[1][1])])
    with pytest.raises(ValueError, match="named_parameters: 1 of the optimizer's 2 parameters"):
        wrap(named_parameters=named[:1])
    with pytest.raises(ValueError, match=r"named_parameters: expected \(name, parameter\)"):
        wrap(named_parameters=list(net.parameters()))
    with pytest.raises(ValueError, match="gradient_predivide_factor: only with op=Average"):
        wrap(op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step: must be an int >= 1"):
        wrap(backward_passes_per_step=0)
    with pytest.raises(ValueError, match="backward_passes_per_step: must be an int >= 1"):
        wrap().set_backward_passes_per_step(0)
    with pytest.raises(ValueError, match="op: expected one of"):
        wrap(op="average")
    with pytest.raises(TypeError, match="compression: expected hvd.Compression"):
        wrap(compression="fp16")
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        hvd.DistributedOptimizer(net)
    with pytest.raises(ValueError, match="groups: must be >= 0"):
        wrap(groups=-1)
    with pytest.raises(TypeError, match="groups: expected an int or a list of lists"):
        wrap(groups="all")
    with pytest.raises(ValueError, match="groups: a parameter that the optimizer does not"):
        wrap(groups=[[torch.nn.Parameter(torch.ones(1))]])
    with pytest.raises(ValueError, match="groups: a parameter in two groups"):
        wrap(groups=[[net.bias], [net.bias]])
    with pytest.raises(ValueError, match="groups: Adasum combines each parameter's update"):
        wrap(groups=2, op=hvd.Adasum)
    with pytest.raises(TypeError, match="sparse_as_dense: expected True or False"):
        wrap(sparse_as_dense="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrap(named_parameters=net.named_parameters())  # a generator is fine


def scheduled_training():
    """A scalar weight from 0, SGD at lr 1, gradient rank + 1, a StepLR (halving) made
    before or after the wrap: (weight after each of 2 steps, the lr each used, warnings)."""
    import warnings

    import torch

    import spark_estimator.horovod as hvd

    hvd.init()
    out = {}
    for order, op in (("before", hvd.Average), ("after", hvd.Average), ("before", hvd.Adasum)):
        w = torch.nn.Parameter(torch.zeros(()))
        opt = torch.optim.SGD([w], lr=1.0)
        if order == "before":
            steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            opt = hvd.DistributedOptimizer(opt, op=op)
        else:
            opt = hvd.DistributedOptimizer(opt, op=op)
            steplr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        weights, lrs, error = [], [], None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for _ in range(2):
                    opt.zero_grad()
                    (w * (hvd.rank() + 1)).backward()
                    lrs.append(opt.param_groups[0]["lr"])
                    opt.step()
                    steplr.step()
                    weights.append(w.item())
            except RuntimeError as e:  # a step that did not reduce leaves its passes counted
                error = str(e)
        out[order, op.name] = (weights, lrs, [str(c.message) for c in caught], error)
    return out


def test_an_lr_scheduler_made_before_or_after_the_wrap_leaves_the_gradients_reduced(spark):
    """Gradients 1 and 2 averaged (or their updates -1 and -2 combined by Adasum: -1.5 too)
    at lr 1, then 0.5: every rank at -1.5, then -2.25. A scheduler made before the wrap
    still drives the rate the wrapped optimizer steps with, and sees its steps (torch warns
    of a scheduler stepped before its optimizer otherwise)."""
    results = run(scheduled_training, num_proc=2, use_gpu=False, spark=spark)
    for out in results:
        for case, (weights, lrs, caught, error) in out.items():
            assert weights == [-1.5, -2.25], case
            assert lrs == [1.0, 0.5], case
            assert caught == [], case
            assert error is None, case
