"""The training step on a real one-process gloo group and a real DDP model."""

from types import SimpleNamespace

import pytest
import torch

from spark_estimator.shared.spec import ColumnSpec, LoopSpec
from spark_estimator.worker.comm.ddp import wrap_model
from spark_estimator.worker.comm.ranks import RankInfo
from spark_estimator.worker.loop.loss import BatchLoss
from spark_estimator.worker.loop.objects import TrainingObjects
from spark_estimator.worker.loop.step import Stepper

CPU = torch.device("cpu")
X = torch.arange(24, dtype=torch.float32).reshape(8, 3) / 10
Y = X.sum(dim=1) * 0.5 - 1


def batch(rows: slice):
    return SimpleNamespace(inputs=[X[rows]], labels=[Y[rows]], sample_weight=None)


def stepper(loop: LoopSpec, compression="none", custom=None):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    ddp, state = wrap_model(net, RankInfo(0, 1, 0, 1, CPU), compression, 60.0)
    objects = TrainingObjects(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        loss=BatchLoss([torch.nn.MSELoss()], [ColumnSpec("y", "scalar", "float32")]),
        base_lrs=[0.1],
        train_minibatch_fn=custom,
    )
    return Stepper(ddp, objects, loop, CPU), net, state


def test_accumulated_halves_equal_the_whole_batch(process_group):
    whole, whole_net, _ = stepper(LoopSpec())
    whole(batch(slice(0, 8)), 1.0, True)
    halves, halves_net, _ = stepper(LoopSpec(backward_passes_per_step=2))
    halves(batch(slice(0, 4)), 0.5, False)
    assert halves_net.weight.grad is not None
    halves(batch(slice(4, 8)), 0.5, True)
    assert torch.allclose(whole_net.weight, halves_net.weight, atol=1e-6)
    assert halves_net.weight.grad is None  # zeroed after the optimizer step
    # (with several processes and gradient_compression: test_estimator_training.py)


def test_one_process_trains_the_model_itself_without_ddp(process_group):
    for compression in ("none", "fp16"):
        step, net, state = stepper(LoopSpec(), compression)
        assert step.ddp is net and state is None


def test_mixed_precision_fp16_uses_a_grad_scaler_and_bf16_does_not(process_group):
    fp16, _, _ = stepper(LoopSpec(mixed_precision="fp16"))
    outputs, loss = fp16(batch(slice(0, 8)), 1.0, True)
    assert outputs[0].dtype == torch.float16 and "scaler" in fp16.state_dict()
    bf16, _, _ = stepper(LoopSpec(mixed_precision="bf16"))
    outputs, _ = bf16(batch(slice(0, 8)), 1.0, True)
    assert outputs[0].dtype == torch.bfloat16 and "scaler" not in bf16.state_dict()


def test_a_custom_step_gets_the_model_optimizer_and_the_estimators_loss(process_group):
    seen = {}

    def custom(model, optimizer, loss_fn, inputs, labels):
        seen["optimizer"] = optimizer
        outputs = model(*inputs)
        return outputs, loss_fn(outputs, labels).item()

    step, net, _ = stepper(LoopSpec(), custom=custom)
    outputs, loss = step(batch(slice(0, 8)), 1.0, True)
    expected = torch.nn.functional.mse_loss(net(X).squeeze(1), Y)
    assert isinstance(loss, torch.Tensor) and loss.item() == pytest.approx(expected.item())
    assert seen["optimizer"] is step.objects.optimizer

    step, _, _ = stepper(LoopSpec(), custom=lambda *args: None)
    with pytest.raises(TypeError, match=r"train_minibatch_fn: must return \(outputs, loss\)"):
        step(batch(slice(0, 8)), 1.0, True)
