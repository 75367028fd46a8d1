"""Asynchronous RL: the rollout on ranks of its own, a queue of scored samples, bounded staleness.

    schedule.py   which weights generate which batch (staleness bound derived from verl's keys), pure arithmetic
    bridge.py     the world split into a trainer world and a rollout world, and the bridge groups between them
    weights.py    the trainer's generation shards broadcast to every replica in planned buckets, with a version
    messages.py   a scored batch on the wire: a head (scores, versions, lengths, the loader's position) and a body of
                  tensors per row (tokens, log-probs, token codes, routing records)
    rows.py       each trainer rank's rows, straight from a rollout rank
    source.py     where the trainer's step gets its batch: the colocated rollout (the synchronous schedule) or the
                  queue the rollout ranks fill
    server.py     the rollout ranks' loop: wait for the weights a batch needs, generate, score, send

docs/async.md says what staleness means and what is guaranteed.
"""
