"""Size and count limits of the wire protocol. Each is part of the contract (docs/protocol.md).

A decoder refuses anything beyond these with ``ErrorCode.OVERSIZED`` before allocating for it.
"""

KiB = 1024
MiB = 1024 * KiB

#: Largest frame (the msgpack payload after the 4-byte length prefix).
MAX_FRAME_BYTES = 16 * MiB
#: Default and largest chunk of a weight snapshot or delta: the one chunk size every weight
#: route serves (broadcast streams, recovery, catch-up, direct fetch).
DEFAULT_CHUNK_BYTES = 256 * KiB
MAX_CHUNK_BYTES = 8 * MiB
#: Strings (peer ids, names, prompt text, multiaddrs).
MAX_STR_BYTES = 64 * KiB
#: One multiaddr (listen / plan addresses): a DNS name, transport, port and ``/p2p/<id>`` fit.
MAX_ADDR_BYTES = 512
#: Any one list (tokens of one completion, tensors of a manifest, chunks of a manifest, ...).
MAX_LIST_LEN = 1 << 20
#: Rollouts in one submission, prompts in one lease, samples per prompt.
MAX_PROMPTS_PER_LEASE = 256
MAX_GROUP_SIZE = 64
MAX_ROLLOUTS_PER_SUBMIT = MAX_PROMPTS_PER_LEASE * MAX_GROUP_SIZE
#: Tokens of one completion (of an episode: its whole transcript after the prompt).
MAX_COMPLETION_TOKENS = 32 * KiB
#: Tokens of one prompt given as token ids (a sampling request of ``echorl serve``): a lease of
#: MAX_PROMPTS_PER_LEASE of them stays under MAX_FRAME_BYTES (≤ 5 B a token id in msgpack).
MAX_PROMPT_TOKENS = 8 * KiB
#: Model turns of one episode.
MAX_EPISODE_TURNS = 256
#: Tensors in one manifest; dims of one tensor.
MAX_TENSORS = 1 << 16
MAX_TENSOR_DIMS = 8
#: A LoRA adapter version: its rank and target module names (``AdapterSpec``).
MAX_LORA_RANK = 4096
MAX_LORA_TARGETS = 64
#: Chunks in one manifest (64 GiB at the default chunk size; a larger model sets larger chunks).
MAX_CHUNKS = 1 << 18
#: Members of one broadcast plan (``PlanAnnounce.members``): the learner trims their addresses to
#: keep the announcement in one frame (``broadcast/members.py``; tests/protocol/test_message_sizes.py);
#: 10,000 members plan in ~0.3 s of CPU, on a worker thread at both ends.
MAX_PLAN_MEMBERS = 16384
#: Peers in one ``Status`` page (a peer's entry is ~0.5 KiB: a page stays under 1 MiB).
MAX_STATUS_PAGE = 1024
DEFAULT_STATUS_PAGE = 256
#: Encoded manifest bytes in one ``CatchUp`` page; its first manifest is sent whatever its size
#: (one manifest of a 60 GB model at the default chunk size is ~13 MB, under the frame cap).
CATCHUP_PAGE_BYTES = 4 * MiB
#: A direct-path ticket (``StreamTicket.ticket``): one fixed length, so a peer cannot size what
#: the dialer sends; the dialer sends its SHA-256 proof, never the bytes themselves.
TICKET_BYTES = 16
#: Maximum msgpack nesting accepted.
MAX_DEPTH = 8
#: Signed records older/newer than this (seconds) are replays / clock errors.
MAX_CLOCK_SKEW_S = 300.0
#: Lowest behaviour log-prob a completion token may carry. A sampled token is never this unlikely
#: (e^-100); below about -88 ``exp(logp - behaviour_logp)`` overflows float32 in the GRPO ratio.
MIN_LOGPROB = -100.0
#: Fastest generation a node may declare or be measured at (tokens/s); derived rates are capped here.
MAX_TOKENS_PER_S = 1e8
