"""Fixtures of the in-process unit tests."""
import pytest


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A one-rank gloo world in this process, for code that calls torch.distributed (barriers, broadcasts) but
    needs no peers: the checkpoint manager and the divergence guard's verdict."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture()
def run_files(tmp_path):
    """Existing train/val parquet paths and a model directory, as validation requires."""
    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_bytes(b"PAR1")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return [f"data.train_files={tmp_path / 'train.parquet'}", f"data.val_files=[{tmp_path / 'val.parquet'}]",
            f"actor_rollout_ref.model.path={tmp_path / 'model'}"]
