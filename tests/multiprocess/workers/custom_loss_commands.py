"""tripod_commands.py's worker with tests/helpers/verl_style_loss.py imported first in every rank, so that
`actor_rollout_ref.actor.policy_loss.loss_mode=verl_style_reinforce` names a loss a test module registered."""
import tests.helpers.verl_style_loss  # noqa: F401  (registers verl_style_reinforce)
from tests.helpers.common import dist_worker
from tests.multiprocess.workers.tripod_commands import main

if __name__ == "__main__":
    dist_worker(main)
