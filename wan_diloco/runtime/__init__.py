"""The network driver around the sans-IO cores: syncer and learner processes, the launcher.

``config`` (one TOML for every process), ``wire`` (core <-> transport messages,
the pluggable fragment codec), ``syncer`` (SyncerCore behind the transport
Handler), ``learner`` + ``netthread`` (training thread + asyncio network
thread), ``launch`` (local processes), and the CLIs ``syncer``, ``learner``,
``launch`` and ``train``.
"""
