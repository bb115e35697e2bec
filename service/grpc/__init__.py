"""The Open Inference Protocol v2 over gRPC (``GRPCInferenceService``) beside the HTTP API.

Off unless ``--grpc-port`` / ``ROBEZ_GRPC_PORT`` is set; ``server.start_grpc`` is called by the app's
lifespan (``service/app.py``), so every worker serves it on the same port (SO_REUSEPORT).
"""
