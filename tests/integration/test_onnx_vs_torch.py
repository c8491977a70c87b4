"""The graphs fly builds compute what the model's PyTorch weights compute. Run on the drafter model (0.5B):
the builder's graph is the same for every size of a family, and two float32 copies of the 1.5B target (one for
each runtime) would take half the machine."""

import torch

from fly_runtime.backends.base import CachedSequence
from fly_runtime.loader import DEFAULT_DRAFT, open_target
from fly_runtime.sources import resolve_model
from tests.integration.conftest import PROMPTS


def test_onnx_logits_match_pytorch(chat_ids):
    """The same weights give the same logits in ONNX Runtime (fp32 graph) and in PyTorch, in a prompt read and in
    a verification pass after it."""
    from fly_runtime.backends.torch_backend import TorchBackend

    model = resolve_model(DEFAULT_DRAFT)
    ids = chat_ids(PROMPTS[0])
    graph = CachedSequence(open_target(model, "fp32"))
    ort_logits = torch.cat([graph.extend(ids), graph.extend([ids[-1], 42, 43])])
    del graph
    torch_backend = TorchBackend(model.weights(), device="cpu")
    pt_logits = torch.cat([torch_backend.forward(ids), torch_backend.forward([ids[-1], 42, 43])])
    del torch_backend
    assert ort_logits.shape == pt_logits.shape
    assert (ort_logits - pt_logits).abs().max().item() < 2e-2 * pt_logits.abs().max().item()
    assert torch.equal(ort_logits.argmax(-1), pt_logits.argmax(-1))
