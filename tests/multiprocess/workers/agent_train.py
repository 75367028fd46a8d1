"""`tripod train` with a multi-turn rollout whose user turns come from a toy interaction, recording what the engine
generated and what the actor trained on: `python tests/multiprocess/workers/agent_train.py train RECIPE k=v ...`
with TRIPOD_TEST_AGENT_LOG=<dir> (tests/multiprocess/test_agent_rollout.py).

The hooks run at import, so they also apply in the ranks `tripod train` spawns (as train_with_hooks.py's):
  * engine/agent/rollout.py's `build_agent` gives every row an interaction that answers "again" after each model
    turn (until multi_turn.max_user_turns), so a random model's rows are multi-turn without calling tools, with a
    turn score per reply and a final score (TURN_SCORE, FINAL_SCORE);
  * every model turn the agent loop's scheduler hands a row (the rollout engine's output, any backend, running batch
    or generate call) appends its context, tokens and log-probs to <dir>/gen.jsonl;
  * every actor update saves its batch's rows to <dir>/update_<k>.pt (rank 0's).
TRIPOD_TEST_AGENT_PLANT=reencode plants the bug the test must catch: every trajectory re-tokenized from its decoded
text (special tokens dropped, as a trainer that re-encodes the conversation does).
"""
import dataclasses
import json
import os
import sys

LOG = os.environ.get("TRIPOD_TEST_AGENT_LOG")


TURN_SCORE, FINAL_SCORE = 0.125, 10.0  # exact in binary: the test finds them in the dumped scores


class Again:
    """A user simulator with the tool runner's InteractionRunner methods; a turn score per reply and a final
    score, which multi_turn.add_rollout_rewards adds to the rule score."""

    async def start(self, key, kwargs):
        pass

    async def respond(self, key, messages):
        return False, "again", TURN_SCORE, {}

    async def finish(self, key):
        return FINAL_SCORE


def _hooks() -> None:
    import torch

    import tripod.engine.agent.rollout as agent_rollout
    from tripod.engine.agent.chat_suffix import ChatSuffix
    from tripod.engine.agent.loop import MODEL, AgentLoop
    from tripod.engine.agent.scheduler import TurnScheduler
    from tripod.engine.workers.ppo_workers import PolicyWorker

    class TalkingRollout(agent_rollout.AgentRollout):
        def generate_rows(self, prompts, params, timer=None, needs=None):
            # rows without an extra_info (a caller that drops them) get no interaction, as with a real config
            infos = [{"interaction_kwargs": {"name": "again"}} if info else info for info in prompts.extra_infos]
            return super().generate_rows(dataclasses.replace(prompts, extra_infos=infos), params, timer, needs)

    def build_agent(cfg, tokenizer, engine, replicas, session, routing_of=None):
        mt, rollout = cfg.actor_rollout_ref.rollout.multi_turn, cfg.actor_rollout_ref.rollout
        return TalkingRollout(AgentLoop(tokenizer, rollout.response_length, ChatSuffix(tokenizer), None, Again(),
                                        mt.max_assistant_turns, mt.max_user_turns), engine, replicas, session,
                              routing_of, mt.add_rollout_rewards)

    agent_rollout.build_agent = build_agent

    if os.environ.get("TRIPOD_TEST_AGENT_PLANT") == "reencode":
        original_run = AgentLoop.run

        def run(self, *args, **kwargs):
            rows, stats = original_run(self, *args, **kwargs)
            for r in rows:
                r.response = list(self.tokenizer.encode(self.tokenizer.decode(r.response, skip_special_tokens=True),
                                                        add_special_tokens=False))
                r.codes, r.log_probs = [MODEL] * len(r.response), [0.0] * len(r.response)
            return rows, stats

        AgentLoop.run = run

    ask = TurnScheduler.generate

    async def recorded(self, row, context, max_new_tokens, seed):  # every model turn the engine gave a row
        out = await ask(self, row, context, max_new_tokens, seed)
        with open(os.path.join(LOG, "gen.jsonl"), "a") as f:
            f.write(json.dumps({"prompt": list(context), "response": out.token_ids, "log_probs": out.log_probs}) + "\n")
        return out

    TurnScheduler.generate = recorded
    update = PolicyWorker.update

    def saved(self, batch, *args, **kwargs):
        if torch.distributed.get_rank() != 0:  # a TP group's ranks update the same rows: rank 0 records them
            return update(self, batch, *args, **kwargs)
        k = len([f for f in os.listdir(LOG) if f.startswith("update_")])
        torch.save({key: batch[key].cpu() for key in ("input_ids", "prompt_lens", "responses", "response_mask",
                                                       "rollout_log_probs", "old_log_probs") if key in batch.tensors},
                   os.path.join(LOG, f"update_{k}.pt"))
        return update(self, batch, *args, **kwargs)

    PolicyWorker.update = saved


if LOG:
    _hooks()

if __name__ == "__main__":
    from tripod.engine.cli import main

    sys.exit(main(sys.argv[1:]))
