"""Tools for developing robez (not installed): a local NATS JetStream cluster, a replicated dev cluster."""
