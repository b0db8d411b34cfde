import pytest

from anytrain.config import ParallelConfig
from anytrain.errors import ConfigError
from anytrain.parallel.mesh import ParallelDims, validate_for_model
from anytrain.parallel.pipeline import rank_stages, stage_layer_ranges


def dims(world, **kw):
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_infer_and_coordinates():
    d = dims(8, dp_replicate=2, tp=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.tp, d.dp) == (1, 2, 2, 2, 4)
    assert d.active == ("dp_replicate", "dp_shard", "tp")
    # TP innermost: ranks 0,1 are TP peers and read the same data
    assert d.dp_rank(0) == d.dp_rank(1) == 0 and d.dp_rank(2) == 1 and d.dp_rank(7) == 3
    assert d.coordinates(5) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "tp": 1}


@pytest.mark.parametrize(
    "world, kw, message",
    [
        (4, dict(dp_shard=3), "parallel: pp=1 x dp_replicate=1 x dp_shard=3 x tp=1 = 3 processes, but the world size"),
        (6, dict(tp=4), "parallel.dp_shard: cannot infer"),
        (4, dict(tp=-1, dp_shard=-1), "only one degree may be -1"),
        (4, dict(pp=0), "parallel.pp: must be a positive degree"),
    ],
)
def test_impossible_layouts(world, kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        dims(world, **kw)


def test_model_constraints():
    with pytest.raises(ConfigError, match="parallel.tp: 3 does not divide the model's 12 query / 4 key-value heads"):
        validate_for_model(dims(3, tp=3), n_layers=4, n_heads=12, n_kv_heads=4)
    with pytest.raises(ConfigError, match="parallel.pp: 8 pipeline stages for 4 layers"):
        validate_for_model(dims(8, pp=8), n_layers=4, n_heads=8, n_kv_heads=8)
    validate_for_model(dims(4, tp=2), n_layers=4, n_heads=8, n_kv_heads=2)
    validate_for_model(dims(2, pp=2), n_layers=4, n_heads=8, n_kv_heads=8, cfg=ParallelConfig(pp=2), n_microbatches=2)


PP2 = dict(pp=2, dp_shard=1)


@pytest.mark.parametrize(
    "world, kw, n_micro, tied, message",
    [
        (
            2,
            dict(PP2, pp_schedule="Interleaved1F1B", pp_virtual_stages=3),
            4,
            False,
            "parallel.pp: 2 x 3 pipeline stages for 4 layers",
        ),
        (2, dict(PP2, pp_virtual_stages=2), 4, False, "parallel.pp_virtual_stages: 1F1B runs one stage per"),
        (
            2,
            dict(PP2, pp_schedule="Interleaved1F1B"),
            4,
            False,
            "parallel.pp_virtual_stages: Interleaved1F1B needs >= 2",
        ),
        (2, PP2, 1, False, "train.micro_batch: 1 micro-batches per step for 2 pipeline ranks"),
        (
            2,
            dict(PP2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2),
            5,
            False,
            "train.micro_batch: Interleaved1F1B needs the micro-batch count \\(5\\) to be a multiple of 2",
        ),
        (2, PP2, 4, True, "parallel.pp: tied embeddings put the embedding and the head on one stage"),
        (4, dict(pp=2, strategy="zero1"), 4, False, "parallel.strategy: zero1 does not combine with tensor/pipeline"),
        (4, dict(tp=2, strategy="ddp"), 4, False, "parallel.strategy: ddp does not combine with tensor/pipeline"),
    ],
)
def test_impossible_pipeline_layouts(world, kw, n_micro, tied, message):
    cfg = ParallelConfig(**kw)
    with pytest.raises(ConfigError, match=message):
        validate_for_model(
            ParallelDims.from_config(cfg, world),
            n_layers=4,
            n_heads=8,
            n_kv_heads=8,
            cfg=cfg,
            n_microbatches=n_micro,
            tied_embeddings=tied,
        )


def test_stage_assignment():
    assert [list(r) for r in stage_layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    assert rank_stages(1, pp=2, virtual=2) == [1, 3]  # round-robin: what Interleaved1F1B expects
    assert rank_stages(0, pp=4, virtual=1) == [0]


@pytest.mark.parametrize("rows, world", [(1, 2), (5, 4), (8, 2), (170, 4), (3, 3)])
def test_zero1_rows_follow_dtensor_shard0(rows, world):
    """ZeRO-1 shard rows are torch.chunk's split (what a Shard(0) DTensor of the full shape expects), padded with
    empty shards, and cover every row exactly once."""
    import torch

    from anytrain.train.optim import _row_range

    chunks = [c.tolist() for c in torch.arange(rows).chunk(world)]
    chunks += [[]] * (world - len(chunks))
    assert [list(range(*_row_range(rows, r, world))) for r in range(world)] == chunks


@pytest.mark.parametrize("strategy", ["auto", "zero1"])
def test_reshard_during_accumulation_needs_fsdp(strategy):
    """Refused once the strategy is resolved (auto = ddp without model parallelism), before the model is touched."""
    import torch

    from anytrain.config import RunConfig
    from anytrain.parallel import parallelize

    cfg = RunConfig()
    cfg.parallel.strategy, cfg.parallel.reshard_during_accumulation = strategy, False
    resolved = "ddp" if strategy == "auto" else strategy
    with pytest.raises(ConfigError, match=f"parallel.reshard_during_accumulation: .* the strategy is {resolved}; set"):
        parallelize(torch.nn.Module(), cfg, dims(2), torch.device("cpu"), torch.float32)


def test_cpu_affinity_shares_whole_physical_cores(tmp_path):
    from anytrain.parallel.env import core_share, physical_cores

    # 4 physical cores with 2 SMT siblings each (CPUs c and c + 4), as Linux numbers them
    for cpu in range(8):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{cpu % 4}\n")
    cores = physical_cores(set(range(8)), str(tmp_path))
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [core_share(cores, r, 2) for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [core_share(cores, r, 3) for r in range(3)] == [[0, 4], [1, 5], [2, 6]]  # one core left over
    assert core_share(cores, 0, 5) is None  # fewer cores than processes: leave the affinity alone
    assert physical_cores({0, 1}, str(tmp_path / "missing")) == [[0], [1]]  # no topology: a CPU per core
