"""The network driver around the sans-IO cores: real processes, wall clock, gRPC over HTTP/2.

``syncer`` (SyncerCore behind the transport Handler), ``learner`` + ``netthread``
(training thread + asyncio network thread; ``learner_main`` its entry points, ``exits``
its exit statuses), ``serde`` (core messages <->
transport frames), ``launch`` (a run's local processes), ``events`` (JSON lines).
"""
