import pytest

from anytrain.config import ParallelConfig
from anytrain.errors import ConfigError
from anytrain.parallel.dims import ParallelDims, validate_for_model


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
    with pytest.raises(ConfigError, match="parallel.pp: pipeline parallelism is not finished"):
        validate_for_model(dims(2, pp=2), n_layers=4, n_heads=8, n_kv_heads=8)
    validate_for_model(dims(4, tp=2), n_layers=4, n_heads=8, n_kv_heads=2)
