"""Seeded sampling: the noise of every sampled token is a function of (lease seed, sample,
position, token) that any engine computes bit-exactly, so the learner can replay the choice.

A lease carries a secret ``sampling_seed`` (the learner draws it per lease and reveals it only in
the lease, docs/protocol.md). Sample ``i`` of the lease (prompt ``k``, draw ``j``: ``i = k·G + j``;
an episode is one sample) picks the token at completion position ``t`` (0 = the first token after
the prompt; in an episode observations count as positions too) by Gumbel-max:

    x_t = argmax_v ( filter(z_v / T) + g(seed, i, t, v) ),   g = −log(−log u),

where ``z`` are the float32 logits, ``filter`` is the nucleus (top-p) filter
(:func:`top_p_filter`) and ``u`` is a uniform in (0, 1) made from a 32-bit integer hash. The hash
uses only 64-bit integer additions, products below 2^48, xors, shifts and masks: no value ever
overflows, so CPU, CUDA and any other torch device (or numpy, or another language) produce the
same bits. ``u`` keeps 23 of them and is exact in float32 (and strictly below 1); the two logarithms run in float32 (a
device's ``log`` may differ in the last bit, ~1e-6 on ``g``, far below the verifier's tolerance;
float64 logarithms cost 6× more on a CPU and bought nothing measurable; on an H200 the hash
bits and uniforms were the CPU's bit for bit and the Gumbel values within 9.5e-7,
docs/engines.md). Temperature 0 is greedy (no noise). The lease's top-k is not a protocol
field: only top-p exists, applied identically.

Gumbel-max draws exactly from ``softmax(filter(z / T))``: seeded sampling changes which random
numbers are used, not the distribution, so what is learned is unchanged.

The verifier (``learner/spot_check.py``) recomputes the logits of the claimed version in one
prefill and, per position, the *gap* ``max_v s_v − s_x`` between the best score and the score of
the submitted token: 0 for an honest engine that computes the same logits, small where engines
round differently (a near-tie can flip), large for a token the seeded sampler would not pick.

vLLM: :class:`VLLMSeededProcessor` is the same rule written against vLLM's per-request logits
processor interface (``(output_token_ids, logits) -> logits``): it sets every logit but the
seeded choice to −inf. It is NOT run here (no GPU, no vLLM in this environment).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
# odd 32-bit constants of the "lowbias32" integer hash (C. Wellons, hash-prospector): full avalanche
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B
GOLDEN = 0x9E3779B9  # spreads token ids over 32 bits before mixing
SAMPLE_SALT, POSITION_SALT = 0x68E31DA4, 0xB5297A4D  # domain separation of the key's inputs


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x ← x · c mod 2^32`` in place, for int64 ``0 ≤ x < 2^32``, without overflow: the
    product is taken in 16-bit halves of ``c`` (every intermediate < 2^48)."""
    high = x * (c >> 16)
    high &= 0xFFFF
    high <<= 16
    x *= c & 0xFFFF
    x += high
    x &= MASK32
    return x


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 over int64 tensors holding 32-bit values (a new tensor; ``x`` is unchanged)."""
    x = x ^ (x >> 16)
    _mul32_(x, MUL1)
    x ^= x >> 15
    _mul32_(x, MUL2)
    x ^= x >> 16
    return x


def _mix_int(x: int) -> int:
    """The same hash on a Python int (keys are per row: no tensor needed)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    return x ^ (x >> 16)


def sample_key(seed: int, sample: int) -> int:
    """The 32-bit key of (lease seed, sample index)."""
    k = _mix_int(seed & MASK32)
    k = _mix_int(k ^ (seed >> 32) & MASK32)
    return _mix_int(k ^ ((sample * SAMPLE_SALT) & MASK32))


def derived_seed(run_seed: int, *parts: int) -> int:
    """A 63-bit lease seed derived from a run's seed and integers naming the lease (train-local's
    trusted actors: reproducible run to run; the network learner draws its seeds secretly
    instead, ``learner/leases.py``)."""
    import hashlib

    text = ":".join(str(int(x)) for x in (run_seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8, person=b"echorl-lease").digest(), "big") >> 1


def row_key(seed: int, sample: int, position: int) -> int:
    """The 32-bit key of (lease seed, sample index, position)."""
    return _mix_int(sample_key(seed, sample) ^ ((position * POSITION_SALT) & MASK32))


_VOCAB_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_table(vocab: int, device: torch.device) -> torch.Tensor:
    import torch

    key = (vocab, str(device))
    if key not in _VOCAB_TABLES:
        _VOCAB_TABLES[key] = (torch.arange(vocab, dtype=torch.int64, device=device) * GOLDEN) & MASK32
    return _VOCAB_TABLES[key]


def _gumbel_of(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[*keys.shape, vocab]`` float32 Gumbel noise of int64 row keys."""
    import torch

    return -torch.log(-torch.log(uniforms(hash_bits(keys, vocab))))


def hash_bits(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[*keys.shape, vocab]`` 32-bit hash values (int64) of int64 row keys and every token id:
    the integers the uniforms are made of, the same bits on every device."""
    return mix32(keys[..., None] ^ _vocab_table(vocab, keys.device))


def uniforms(bits: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1) of 32-bit hash values: the top 23 bits, ``(k + 0.5) / 2^23``
    (exact in float32 and below 1; 24 bits would round the top value to 1.0, a draw of +inf)."""
    import torch

    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel(keys: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(keys), vocab]`` float32 Gumbel noise for rows of :func:`row_key` keys."""
    import torch

    return _gumbel_of(torch.tensor(list(keys), dtype=torch.int64, device=torch.device(device)), vocab)


def scores(logits: torch.Tensor, temperature: float, top_p: float, noise: torch.Tensor | None) -> torch.Tensor:
    """The Gumbel-max scores ``filter(z / T) + g`` (float32; ``noise`` None: greedy)."""
    z = logits.float()
    if temperature <= 0 or noise is None:
        return z
    return top_p_filter(z / temperature, top_p) + noise


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: logits outside the smallest set of top tokens whose mass reaches
    ``top_p`` become −inf (the top token is always kept)."""
    import torch

    if top_p >= 1.0:
        return logits
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass before it already reaches top_p
    drop = probs.cumsum(-1) - probs >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


#: noise of several decoding steps is made in one pass (fewer small tensor ops per token); this
#: bounds that block's bytes (float64 rows × vocabulary × steps)
NOISE_BLOCK_BYTES = 32 << 20


class SeededRows:
    """The seeded sampler of one ``sample_ids`` batch: the lease seed, each row's sample index in
    the lease, the completion position of each row's first new token, and (a hint) how many
    steps may follow, so the noise of several steps is made at once."""

    def __init__(self, seed: int, samples: list[int], starts: list[int], steps: int = 1) -> None:
        import torch

        self.seed, self.samples, self.starts, self.steps = int(seed), list(samples), list(starts), max(1, steps)
        self._keys = torch.tensor([sample_key(self.seed, i) for i in self.samples], dtype=torch.int64)
        self._starts = torch.tensor(self.starts, dtype=torch.int64)
        self._block: torch.Tensor | None = None
        self._first = 0

    def noise(self, step: int, vocab: int, device: torch.device | str) -> torch.Tensor:
        """``[rows, vocab]`` noise of the token at ``starts + step``."""
        import torch

        block = self._block
        if block is None or not self._first <= step < self._first + block.shape[0] or block.shape[-1] != vocab:
            per_step = max(1, len(self.samples) * vocab * 8)
            n = max(1, min(self.steps - step, NOISE_BLOCK_BYTES // per_step))
            dev = torch.device(device)
            pos = self._starts.to(dev)[None, :] + torch.arange(step, step + n, device=dev)[:, None]
            keys = mix32(self._keys.to(dev)[None, :] ^ ((pos * POSITION_SALT) & MASK32))
            self._block, self._first = _gumbel_of(keys, vocab), step
            block = self._block
        return block[step - self._first]

    def choose(self, logits: torch.Tensor, step: int, temperature: float, top_p: float) -> torch.Tensor:
        """The token of every row at ``step`` (logits ``[rows, vocab]``)."""
        if temperature <= 0:
            return logits.float().argmax(-1)
        return scores(logits, temperature, top_p, self.noise(step, logits.shape[-1], logits.device)).argmax(-1)


def sampling_gaps(
    logits: torch.Tensor, tokens: torch.Tensor, keys: Sequence[int], temperature: float, top_p: float
) -> torch.Tensor:
    """Per position, ``max_v s_v − s_x`` for the submitted tokens ``x`` (``logits [n, vocab]``,
    ``keys``: each position's :func:`row_key`). A token outside the learner's nucleus is scored
    unfiltered, so a near-boundary disagreement costs a small gap, not an infinite one."""
    import torch

    if tokens.numel() == 0:
        return torch.zeros(0, dtype=torch.float64)
    if temperature > 0:
        noise = gumbel(keys, logits.shape[-1], logits.device)
        s = scores(logits, temperature, top_p, noise)
        raw = logits.float() / temperature + noise
    else:
        s = raw = logits.float()
    chosen = raw.gather(-1, tokens[:, None].to(logits.device)).squeeze(-1)
    return (s.max(-1).values - chosen).clamp(min=0.0).double().cpu()


class VLLMSeededProcessor:
    """Seeded sampling in vLLM as a per-request logits processor (NOT run here: no vLLM/GPU).

    vLLM calls ``processor(output_token_ids, logits)`` once per decoding step of one request,
    ``logits`` a 1-D float tensor over the vocabulary. This returns logits where every entry but
    the seeded Gumbel-max choice is −inf, so vLLM's own sampler (any temperature) must pick that
    token. The behaviour log-probs must then be taken from the unmodified logits (vLLM's
    ``logprobs`` reflect processed logits), which the vLLM backend does by requesting prompt
    log-probs of the completion in a second pass; until that pass exists the vLLM engine does not
    advertise seeded sampling.
    """

    def __init__(self, seed: int, sample: int, temperature: float, top_p: float) -> None:
        self.seed, self.sample = int(seed), int(sample)
        self.temperature, self.top_p = float(temperature), float(top_p)

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        import torch

        rows = SeededRows(self.seed, [self.sample], [len(output_token_ids)], 1)
        pick = int(rows.choose(logits[None, :], 0, self.temperature, self.top_p)[0])
        out = torch.full_like(logits, float("-inf"))
        out[pick] = 0.0
        return out
