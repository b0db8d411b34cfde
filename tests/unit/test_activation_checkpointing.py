"""train.activation_checkpointing through parallelize(): what each policy checkpoints, the activation bytes autograd
keeps for backward (measured with saved_tensors_hooks; on these 4-layer debug models none > selective > full, e.g.
Transformer 1.60 / 0.94 / 0.28 MB and Mamba 6.49 / 3.37 / 0.25 MB), and losses and gradients equal to those without
checkpointing."""

import pytest
import torch

from anytrain.config import load_config
from anytrain.cost.memory import ac_fraction
from anytrain.errors import ConfigError
from anytrain.models import build_model
from anytrain.parallel import parallelize
from anytrain.parallel.ac import checkpointed_blocks
from anytrain.parallel.mesh import ParallelDims

POLICIES = ("none", "selective", "full")
FAMILIES = {"transformer": ("debug", {"n_layers": 4}), "mamba": ("debug", {"n_layers": 4})}


def _model(arch: str, policy: str):
    flavour, args = FAMILIES[arch]
    cfg = load_config(
        None, ["--model.arch", arch, "--model.flavour", flavour, "--train.activation_checkpointing", policy]
    )
    cfg.model.args = dict(args)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model, _ = parallelize(
        model, cfg, ParallelDims.from_config(cfg.parallel, world_size=1), torch.device("cpu"), torch.float32
    )
    return model


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 32), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def saved_activation_bytes(model, tokens, targets) -> tuple[torch.Tensor, int]:
    """(loss, bytes of the distinct non-parameter tensors autograd saves for backward during the forward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    return loss, sum(saved.values())


def test_policies_pick_blocks():
    blocks = [torch.nn.Linear(1, 1) for _ in range(5)]
    assert checkpointed_blocks(blocks, "none") == []
    assert checkpointed_blocks(blocks, "full") == blocks
    assert checkpointed_blocks(blocks, "selective") == [blocks[1], blocks[3]]  # every other block, from the second
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        checkpointed_blocks(blocks, "some")


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_each_policy_saves_less_and_computes_the_same(arch):
    results, keys = {}, {}
    for policy in POLICIES:
        model = _model(arch, policy)
        tokens, targets = _batch(model.args.vocab_size)
        loss, nbytes = saved_activation_bytes(model, tokens, targets)
        loss.backward()
        grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
        results[policy] = (loss.detach(), nbytes, grads)
        keys[policy] = list(model.state_dict())
    none, selective, full = (results[p][1] for p in POLICIES)
    assert none > selective > full, {p: results[p][1] for p in POLICIES}
    # the cost model's share of checkpointed blocks (4 blocks: 2 under selective) is the measured share of the saving
    assert none - selective == pytest.approx(ac_fraction("selective") * (none - full), rel=0.02)
    for policy in ("selective", "full"):
        loss, _, grads = results[policy]
        torch.testing.assert_close(loss, results["none"][0], rtol=0, atol=0)
        assert keys[policy] == keys["none"]  # checkpoint wrappers leave the state-dict keys unchanged (DCP)
        assert grads.keys() == results["none"][2].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results["none"][2][name], rtol=1e-6, atol=1e-7, msg=name)
