"""A batch sharded by DP rank (engine/workers/row_shards.py) on 3 gloo ranks that each need a random share of the
rows (tests/multiprocess/workers/row_shards_check.py): the rollout exchange delivers each rank exactly the rows it
names, its batch holds exactly those rows laid out as in the whole batch, and the statistics the step reads over the
whole batch (GAE's advantage whitening, the KL-in-reward mean, rollout correction's mismatch metrics, batch_metrics,
GRPO's and RLOO's group advantages, reinforce_plus_plus(_baseline)'s whitened ones) reduced over the ranks equal those of the whole batch on one rank, and so does
rollout correction on the rows (IS weights, rejection: the mask, the metrics, every row's counted tokens after the
rejection and the advantages; with the counts not summed over the ranks it fails). That a run
keeps its rows sharded and still trains like one rank is test_layout_equivalence.py's check."""
from tests.helpers.common import run_torchrun


def test_sharded_statistics_equal_the_whole_batch():
    out = run_torchrun("row_shards_check.py", 3, timeout=120).stdout
    assert out.count("ROW_SHARDS_OK") == 3, out[-3000:]
