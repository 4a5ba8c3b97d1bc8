"""Exact held-out evaluation: the probability the policy gives a turn, computed from the model's
logits instead of sampled, for the tasks that can turn it into their expected reward
(``Task.exact_eval``: addition's probability of the right answer, Kuhn poker's expected chips
over every deal).

:class:`ModelPolicy` answers a task's :class:`~echorl.tasks.base.Query` list: the episode so far
(each piece tokenised on its own and concatenated, as the rollout loop does), the turn's text
and whether the turn must end there with EOS. The probability is that of the sampling
distribution the actors use: ``softmax(logits / T)`` (greedy at T = 0: 1 if every token of the
turn is the argmax, else 0). A text with another tokenisation than the canonical one is not
counted, so a task's exact figure is exact for the canonical tokenisation.
Runs in a worker thread (it is the loop's evaluation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.tasks.base import Query

ROWS_PER_PASS = 128
"""Queries scored per forward pass: bounds the activations' memory (a short query is ~30 tokens)."""


class ModelPolicy:
    """The policy of ``backend``'s model at sampling ``temperature``, as a task's ``TurnPolicy``."""

    def __init__(self, backend: TorchBackend, temperature: float) -> None:
        self.backend, self.temperature = backend, float(temperature)
        self.eos = sorted(backend.eos_ids)

    def probs(self, queries: list[Query]) -> list[float]:
        """The probability of each query's turn given its episode so far."""
        import torch

        out: list[float] = []
        model = self.backend.model
        was_training = model.training
        model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(queries), ROWS_PER_PASS):
                    out.extend(self._chunk(queries[start : start + ROWS_PER_PASS]))
        finally:
            if was_training:
                model.train()
        return out

    def _chunk(self, queries: list[Query]) -> list[float]:
        import torch

        enc = self.backend.encode
        rows = [([t for piece in q.turns for t in enc(piece)], enc(q.text), q.end) for q in queries]
        width = max(len(c) + len(t) + int(end) for c, t, end in rows)
        ids = torch.full((len(rows), width), self.backend.pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, (ctx, turn, _) in enumerate(rows):
            ids[i, : len(ctx) + len(turn)] = torch.tensor(ctx + turn)
            att[i, : len(ctx) + len(turn) + 1] = 1
        dev = next(self.backend.model.parameters()).device
        logits = self.backend.model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits.float()
        return [self._turn_prob(logits[i], len(ctx), turn, end) for i, (ctx, turn, end) in enumerate(rows)]

    def _turn_prob(self, logits: torch.Tensor, n_ctx: int, turn: list[int], end: bool) -> float:
        """P(``turn`` then, if ``end``, an EOS) from one row's logits (position p predicts p + 1)."""
        import torch

        steps = logits[n_ctx - 1 : n_ctx - 1 + len(turn) + int(end)]
        if self.temperature == 0:
            top = steps.argmax(-1).tolist()
            ok = top[: len(turn)] == turn and (not end or top[-1] in self.eos)
            return 1.0 if ok else 0.0
        logp = torch.log_softmax(steps / self.temperature, dim=-1)
        total = float(logp[torch.arange(len(turn)), torch.tensor(turn, dtype=torch.long)].sum()) if turn else 0.0
        if end:
            total += float(torch.logsumexp(logp[-1, self.eos], dim=-1))
        return float(torch.exp(torch.tensor(total)))
