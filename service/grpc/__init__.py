"""The Open Inference Protocol v2 over gRPC (``GRPCInferenceService``) beside the HTTP API.

Off unless ``--grpc-port`` / ``ROBEZ_GRPC_PORT`` is set; ``server.start_grpc`` is called by the app's
lifespan (``service/app.py``), so every worker serves it on the same port (SO_REUSEPORT).
"""

# gRPC core's settings for a worker that serves gRPC, unless the operator sets GRPC_EXPERIMENTS: iomgr's TCP
# listener and endpoints instead of the EventEngine's. The EventEngine's poller threads cost ~35 µs more
# server CPU a call (1-id ModelInfer, one caller: 105 -> 71 µs in gRPC's own threads, 408 -> 346 µs in
# all; docs/benchmarks/grpc-2026-11-28.md). gRPC reads the variable when it is imported, so the CLI sets it
# before any worker imports it (``service/cli.py``); a grpcio without these experiments logs
# "Unknown experiment" and runs its defaults.
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"
