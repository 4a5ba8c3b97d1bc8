"""The learner peer (``echorl learner``): the RL core of ``echorl/rl`` fed by signed network rollouts.

Start-up wiring: ``peer.py`` (the command: builds the loop with ``rl/build.py``, the host, the
broadcaster and the service, each once, handing each what it needs through its constructor).

The network service, ``service.py`` (``LearnerService``: join, lease, submit, return and status
handlers) over components that each own one thing:

- ``peers.py``: ``PeerBook`` (every per-peer fact: ``PeerRecord``, ``PeerLoad``, ``PeerAccount``,
  flags, addresses; one ``forget``);
- ``leases.py``: ``LeaseBook`` (single-use leases, nonces);
- ``admission.py``: ``Admission`` (held versions, lease limits, deadlines, back-off) and what a
  submission's groups must be (``convert_submission``); ``newcomers.py``: ``Newcomers`` (the
  unproven peers' share of the in-flight budget, earned by answers in time, split by address);
  ``grants.py``: ``GrantPace`` (leases granted no faster than the loop checks their results);
- ``checks.py``: ``SubmitChecks`` and ``CHECKS`` (every submission check as one ordered table);
- ``policing.py``: ``Police`` (spot checks, flags, bans) with ``spot_check.py`` (``SpotChecker``)
  and ``tolerances.py`` (per engine and dtype);
- ``roster.py``: ``Roster`` (per-IP join slots, broadcast plans, idle members);
- ``activation.py``: ``Activator`` and ``choose_active`` (cost-aware choice of active nodes);
- ``membership.py``: ``Members``, ``RunEnd`` (one live process per key, dial-back, the run's end);
- ``ledger.py``: ``Ledger`` (signed receipts, rejections by reason, cost);
- ``liveness.py``: ``Liveness`` (pings quiet members; one that does not answer is lost) and
  ``LoopLag`` (how late the trio loop runs: a ping timed out while it was late is excused).
- ``upkeep.py``: ``Upkeep`` (the maintenance loop: overdue leases expire, idle members dropped,
  refused joiners' connections closed, the liveness sweep, activation re-decided; a lost member's
  leases expire at once).

Beside the service: ``train.py`` (``NetworkSource``: the loop's rollout source; ``Provisioning``:
the required throughput of architecture §7), ``publish.py`` (``Publisher``: broadcasting a version
overlaps training), ``resume.py`` (what a checkpoint keeps of the network side: bans, accounts,
node addresses), ``config.py`` (``LearnerConfig``; ``ServiceFields``, one section per component).

Imports ``protocol``, ``net``, ``broadcast``, ``actor``, ``tasks``, ``rl`` and ``common``; never
``echorl.node``.
"""
