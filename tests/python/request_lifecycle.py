"""The requests of the two serving simulations (pool_simulation.run_pool_simulation, serving_helpers.simulate_serving)
and their random lifecycle on one state pool: each request owns T_SPEC pool rows (the slots of speculative
decode), and the rows of finished requests go back to the free list as NaN, so that a stray read or write
shows."""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

import torch

T_SPEC = 4  # 1 + 3 drafts: the pool rows each request owns
NAN = float("nan")


class Request:
    def __init__(self, rid, rows):
        self.rid = rid
        self.rows = rows  # T_SPEC pool rows owned; the accepted state lives in rows[self.cur]
        self.cur = 0
        self.stream = {name: [] for name in ("q", "k", "v", "g", "beta")}  # accepted tokens, in order
        self.started = False

    def accept(self, inp, start, count):
        """Tokens start .. start + count - 1 of a varlen call."""
        for name in self.stream:
            self.stream[name].append(inp[name][0, start:start + count])

    def accept_row(self, inp, row, count):
        """The first `count` tokens of row `row` of a fixed-layout call."""
        for name in self.stream:
            self.stream[name].append(inp[name][row, :count])

    def accept_rows(self, inp, rows, count):
        """The tokens in the first `count` of `rows` (dim 1) of a step's inputs (token_rows layout)."""
        for name in self.stream:
            self.stream[name].append(inp[name][0, rows[:count]])

    def tokens(self, name):
        return torch.cat(self.stream[name], 0) if self.stream[name] else None


class Requests:
    """The live requests of a simulation and the free rows of its pool (``P`` rows, shuffled by ``rng``).

    ``max_live``: no arrivals while that many requests live.  ``action_cuts``: the cumulative
    probabilities with which an older request finishes, continues its prefill, decodes or spec-decodes
    in a step (idle otherwise)."""

    def __init__(self, rng: random.Random, P: int, max_live: int, action_cuts: Tuple[float, float, float, float]):
        self.rng = rng
        self.free = list(range(P))
        rng.shuffle(self.free)
        self.live: List[Request] = []
        self.next_id = 0
        self.max_live = max_live
        self.action_cuts = action_cuts

    def next_step(self, pools: Sequence[torch.Tensor], counts: Dict[str, int]) -> Dict[str, List[Request]]:
        """One step's arrivals (while T_SPEC rows are free, each with probability 1/2) and an action for
        every older request; a finishing request's rows are set to NaN in each of ``pools`` and freed.
        Returns the requests to prefill (the new ones first), decode and spec-decode."""
        rng = self.rng
        new = []
        while len(self.free) >= T_SPEC and len(self.live) < self.max_live and rng.random() < 0.5:
            r = Request(self.next_id, [self.free.pop() for _ in range(T_SPEC)])
            self.next_id += 1
            self.live.append(r)
            new.append(r)
        acts = {"prefill": list(new), "decode": [], "spec": []}
        finish, prefill, decode, spec = self.action_cuts
        for r in list(self.live):
            if r in new:
                continue
            x = rng.random()
            if x < finish:
                self.live.remove(r)
                for pool in pools:
                    pool[r.rows] = NAN
                self.free.extend(r.rows)
                counts["finished"] += 1
            elif x < prefill:
                acts["prefill"].append(r)
            elif x < decode:
                acts["decode"].append(r)
            elif x < spec:
                acts["spec"].append(r)
        return acts
