"""Real sync steps with int8 uploads and error feedback, through the aggregator's upload path, lower the loss."""

from __future__ import annotations

import torch

from crowdtrain_agent.codec import get_codec
from crowdtrain_agent.feedback import ErrorFeedback, SliceKey
from crowdtrain_agent.models import get_model
from crowdtrain_agent.protocol import OptimizerSpec, StepApplied, UploadReceipt
from crowdtrain_backbone.server import BackboneServer

from .conftest import MLP, MLP_PARAMS, Agent, FakeSite, assignment, ticket

SAMPLES = 64


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 4, generator=generator)
    y = (x @ torch.randn(4, 3, generator=generator)).argmax(dim=1)
    return x, y


def _loss_and_summed_grad(params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """What an agent computes for a lease: the mean loss and the gradient summed over the lease's samples."""
    net = get_model("mlp").build(MLP.config, seed=1234)
    torch.nn.utils.vector_to_parameters(params, net.parameters())
    loss = torch.nn.functional.cross_entropy(net(x), y, reduction="sum")
    loss.backward()
    grad = torch.nn.utils.parameters_to_vector(p.grad for p in net.parameters())  # type: ignore[misc]
    return float(loss.detach()) / len(y), grad.detach()


async def test_int8_sync_steps_with_error_feedback_lower_the_loss(
    site: FakeSite, agent: Agent, backbone: BackboneServer
) -> None:
    order = assignment(bounds=(0, MLP_PARAMS), staleness=0, codec="int8", codec_block_size=32,
                       optimizer=OptimizerSpec(name="adamw", lr=3e-2))  # fmt: skip
    await site.assign(order)
    codec = get_codec("int8", 32)
    feedback = ErrorFeedback()
    key = SliceKey(1, MLP_PARAMS, "int8", 32, 0, MLP_PARAMS)
    x, y = _data()
    state = backbone.node.get_slice(1, 0)
    losses = []

    for step in range(25):
        loss, grad = _loss_and_summed_grad(state.param.detach().clone(), x, y)
        losses.append(loss)
        payload = feedback.encode(key, grad, codec)
        reply = await agent.upload(ticket(step + 1, base_version=step, num_samples=SAMPLES), grad, codec="int8",
                                   codec_block_size=32, payload=payload)  # fmt: skip
        assert isinstance(reply, UploadReceipt), reply
        applied = await site.commit(step, [step + 1], SAMPLES)
        assert isinstance(applied, StepApplied), applied

    assert len(payload) == MLP_PARAMS + 3 * 4  # 67 values in blocks of 32: three scales
    assert losses[-1] < 0.6 * losses[0], losses
