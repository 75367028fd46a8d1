"""algorithm.rollout_correction.rollout_is defaults to auto (issue 44 item 4): token-level TIS when the batches can be
stale (the rollout on its own ranks with an age bound above 0, or partial rollouts) and bypass_mode is off, else null;
resolved once when the config is built, so nothing downstream sees "auto". An explicit null with stale batches is
kept and `tripod train` prints one line about it on rank 0 (engine/preflight.py)."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tripod.engine.algorithms.rollout_correction import correct_batch
from tripod.engine.config import AlgorithmConfig, RolloutCorrectionConfig, TripodConfig, config_to_yaml, load_config
from tripod.engine.launch import Launch
from tripod.engine.preflight import prepare_train

RC = "algorithm.rollout_correction"
OWN = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1"]  # the rollout on a rank of its own
STALE = OWN + ["async_training.staleness_threshold=1"]  # samples up to one optimizer step old
NOTE = "is on-policy in name only"


def _rc(overrides):
    return load_config(None, overrides).algorithm.rollout_correction


@pytest.mark.parametrize("overrides", [
    [],  # colocated
    ["async_training.staleness_threshold=2", "async_training.partial_rollout=true"],  # read only with own ranks
    OWN,  # staleness 0, K = 1: the synchronous run, bit for bit
    OWN + ["async_training.staleness_threshold=0.5"],  # floor(1.5 x 1) = 1 batch ahead: still age 0
], ids=["colocated", "colocated_with_async_keys", "own_ranks_staleness_0", "own_ranks_staleness_0.5"])
def test_auto_is_off_where_every_sample_is_on_policy(overrides):
    cfg = load_config(None, overrides)
    rc = cfg.algorithm.rollout_correction
    assert not cfg.stale_batches and rc.rollout_is is None and not rc.active and not rc.bypass_mode
    assert cfg.rollout_correction_note() is None


@pytest.mark.parametrize("overrides, age", [
    (STALE, 1),
    (OWN + ["async_training.trigger_parameter_sync_step=2"], 1),  # staleness 0 but K = 2: ages 0, 1, 0, 1, ...
    (OWN + ["async_training.partial_rollout=true"], 0),  # a version may land between two tokens
    (OWN + ["async_training.staleness_threshold=2", "async_training.partial_rollout=true"], 2),
], ids=["staleness_1", "sync_every_2", "partial_rollout", "staleness_2_partial"])
def test_auto_is_token_tis_with_stale_batches(overrides, age):
    cfg = load_config(None, overrides)
    rc = cfg.algorithm.rollout_correction
    assert cfg.stale_batches and cfg.async_training.max_age == age
    assert rc.rollout_is == "token" and rc.active and rc.rollout_is_threshold == 2.0 and rc.rollout_rs is None
    assert cfg.rollout_correction_note() is None


def test_the_resolved_bound_is_the_tis_bound():
    """What the trainer hands correct_batch: token weights exp(old - rollout) clamped at rollout_is_threshold (2.0)."""
    rc = _rc(STALE)
    old = torch.log(torch.tensor([[0.9, 0.6, 0.5]]))
    rollout = torch.log(torch.tensor([[0.3, 0.6, 0.25]]))  # ratios 3, 1, 2
    batch = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": torch.tensor([[1.0, 1.0, 0.0]])}
    metrics, kept = correct_batch(batch, rc)
    torch.testing.assert_close(batch["rollout_is_weights"], torch.tensor([[2.0, 1.0, 0.0]]))
    assert kept == 2 and metrics["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


def test_bypass_mode_keeps_the_correction_off():
    cfg = load_config(None, STALE + [f"{RC}.bypass_mode=true"])
    rc = cfg.algorithm.rollout_correction
    assert cfg.stale_batches and rc.bypass_mode and rc.rollout_is is None and not rc.active
    assert rc.check() == [] and cfg.rollout_correction_note() is None  # not refused as bypass + rollout_is


@pytest.mark.parametrize("overrides", [[], STALE], ids=["colocated", "stale"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_explicit_level_is_kept(overrides, level):
    cfg = load_config(None, overrides + [f"{RC}.rollout_is={level}"])
    assert cfg.algorithm.rollout_correction.rollout_is == level and cfg.algorithm.rollout_correction.active
    assert cfg.rollout_correction_note() is None


def test_an_explicit_null_with_stale_batches_stays_off_and_says_so():
    cfg = load_config(None, STALE + [f"{RC}.rollout_is=null"])
    rc = cfg.algorithm.rollout_correction
    assert rc.rollout_is is None and not rc.active
    note = cfg.rollout_correction_note()
    assert note.startswith(f"{RC}.rollout_is=null with stale batches (samples up to 1 trainer step(s) old)")
    assert NOTE in note and f"{RC}.rollout_is=auto" in note and "min(pi_old / pi_rollout, 2)" in note
    assert "\n" not in note
    partial = load_config(None, OWN + ["async_training.partial_rollout=true", f"{RC}.rollout_is=null",
                                       f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=1.5"])
    assert partial.algorithm.rollout_correction.active  # rejection alone still needs the recompute
    assert "(partial rollouts)" in partial.rollout_correction_note()
    assert "rollout_rs=seq_mean_k1 only drops sequences" in partial.rollout_correction_note()
    assert load_config(None, [f"{RC}.rollout_is=null"]).rollout_correction_note() is None  # colocated: on-policy


def test_nothing_downstream_sees_auto(tmp_path):
    """The YAML a rank rebuilds its config from (cli/train.py), and the run's saved config.yaml, hold the resolved
    value; the default-built config resolves too. Only the schema's defaults (recipes/defaults.yaml) say auto."""
    for overrides, want in (([], None), (STALE, "token")):
        cfg = load_config(None, overrides)
        text = config_to_yaml(cfg)
        assert "auto" not in text.split("rollout_correction:")[1].split("rollout_rs:")[0]
        on_rank = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(text)))
        assert on_rank.algorithm.rollout_correction.rollout_is == want and on_rank == cfg
        from tripod.engine.config import save_resolved_config

        assert load_config(save_resolved_config(cfg, tmp_path / str(want)), []) == cfg
    assert TripodConfig().algorithm.rollout_correction.rollout_is is None
    assert OmegaConf.to_object(OmegaConf.structured(TripodConfig)).algorithm.rollout_correction.rollout_is is None
    assert OmegaConf.structured(TripodConfig).algorithm.rollout_correction.rollout_is == "auto"  # the schema's default


def test_an_unresolved_section_checks_but_is_not_read():
    assert RolloutCorrectionConfig().rollout_is == "auto" and AlgorithmConfig().check() == []
    assert RolloutCorrectionConfig(bypass_mode=True).check() == []  # auto resolves to null under bypass_mode
    with pytest.raises(RuntimeError, match="rollout_is=auto was not resolved"):
        RolloutCorrectionConfig().active
    section = RolloutCorrectionConfig()
    section.resolve(stale_batches=True)
    assert section.rollout_is == "token"
    section.resolve(stale_batches=False)  # resolved once: an explicit value is never touched again
    assert section.rollout_is == "token"
    assert any("rollout_is='auto2'" in p for p in RolloutCorrectionConfig(rollout_is="auto2").check())


def test_max_age_follows_the_schedule():
    from tripod.engine.async_rollout.schedule import StalenessSchedule

    for s in (0.0, 0.5, 0.99, 1.0, 1.5, 2.0):
        for k in (1, 2, 3):
            age = load_config(None, OWN + [f"async_training.staleness_threshold={s}",
                                           f"async_training.trigger_parameter_sync_step={k}"]).async_training.max_age
            assert age == StalenessSchedule(s, k, 0).max_age == math.floor((1 + s) * k + 1e-9) - 1
    assert load_config(None, ["async_training.trigger_parameter_sync_step=0"]).async_training.max_age == 0  # refused


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rc_default")
    paths = make_ppo_setup(tmp)
    paths["run"] = str(tmp / "run")
    return paths


def _train_overrides(setup, *extra):
    # one trainer rank and one rollout rank; require_batches x ppo_mini_batch_size = data.train_batch_size (4)
    return tiny_overrides(setup, setup["run"]) + ["async_training.require_batches=2", *extra]


def test_tripod_train_prints_the_note_once_on_rank_zero(setup, capsys):
    cfg, world = prepare_train(None, _train_overrides(setup, *STALE, f"{RC}.rollout_is=null"), Launch("local", 0))
    assert world == 2 and cfg.algorithm.rollout_correction.rollout_is is None
    lines = [line for line in capsys.readouterr().out.splitlines() if NOTE in line]
    assert lines == [cfg.rollout_correction_note()]
    launch = Launch("torchrun", 2, rank=1, local_rank=1, nproc_per_node=2, nnodes=1)  # every rank checks; rank 1 is quiet
    prepare_train(None, _train_overrides(setup, *STALE, f"{RC}.rollout_is=null"), launch)
    assert NOTE not in capsys.readouterr().out


@pytest.mark.parametrize("extra, want", [(STALE, "token"), (STALE + [f"{RC}.bypass_mode=true"], None), ([], None)],
                         ids=["stale", "stale_bypass", "colocated"])
def test_tripod_train_validates_the_resolved_config_quietly(setup, capsys, extra, want):
    cfg, _ = prepare_train(None, _train_overrides(setup, *extra), Launch("local", 0))
    assert cfg.algorithm.rollout_correction.rollout_is == want
    assert NOTE not in capsys.readouterr().out
