#!/usr/bin/env bash
# kubernetes-validate (PyPI) --strict on every manifest in deploy/k8s/, against
# the Kubernetes schemas it ships, and the pieces the deployment relies on:
# the server StatefulSet behind a headless Service and covered by a
# PodDisruptionBudget; workers in two flavours chosen by the nodes' NVIDIA GPU
# label (a DaemonSet on the CUDA image requesting nvidia.com/gpu where the
# label exists, a Deployment on the CPU image where it does not) with
# selectors that cannot claim each other's pods; gRPC readiness and liveness
# probes on the health ports; resource requests and limits on every
# container; non-root pods; Prometheus scrape annotations.
# Usage: k8s_validate_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
VALIDATE=$(find_tool kubernetes-validate "$2")
shopt -s nullglob
manifests=("$SRC"/deploy/k8s/*.yaml)
((${#manifests[@]} >= 7)) || fail "expected at least 7 manifests in deploy/k8s, found ${#manifests[@]}"
"$VALIDATE" --strict --quiet "${manifests[@]}"
python3 - "${manifests[@]}" <<'PY' || fail "deploy/k8s lacks a required piece (above)"
import sys
try:
    import yaml
except ImportError:
    sys.exit("python3 has no yaml module (Debian: python3-yaml)")

docs = [d for path in sys.argv[1:] for d in yaml.safe_load_all(open(path)) if d]
by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
problems = []
def need(cond, what):
    if not cond:
        problems.append(what)

for kind in ("Namespace", "StatefulSet", "DaemonSet", "Deployment", "ConfigMap", "Secret",
             "Service", "PodDisruptionBudget"):
    need(kind in by_kind, "no %s" % kind)
server = by_kind.get("StatefulSet", {}).get("pstrain-server")
gpu = by_kind.get("DaemonSet", {}).get("pstrain-worker-gpu")
cpu = by_kind.get("Deployment", {}).get("pstrain-worker-cpu")
need(server and gpu and cpu, "StatefulSet pstrain-server, DaemonSet pstrain-worker-gpu and "
     "Deployment pstrain-worker-cpu")
if problems:
    print("\n".join("missing: " + p for p in problems))
    sys.exit(1)
need(by_kind["Service"]["pstrain-server"]["spec"].get("clusterIP") == "None",
     "the server Service is not headless")
pdbs = [p for p in by_kind["PodDisruptionBudget"].values()
        if p["spec"]["selector"]["matchLabels"].items() <=
        server["spec"]["template"]["metadata"]["labels"].items()]
need(len(pdbs) == 1, "no PodDisruptionBudget selects the server pods")

GPU_LABELS = {"nvidia.com/gpu.present", "nvidia.com/gpu"}
def node_terms(w):
    affinity = w["spec"]["template"]["spec"].get("affinity", {}).get("nodeAffinity", {})
    return affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
# GPU: any term with a GPU label Exists; CPU: every GPU label DoesNotExist, in its only term.
gpu_terms = node_terms(gpu)
need(gpu_terms and all(any(e["key"] in GPU_LABELS and e["operator"] == "Exists"
                           for e in t["matchExpressions"]) for t in gpu_terms),
     "the GPU DaemonSet is not limited to nodes with an NVIDIA GPU label")
cpu_terms = node_terms(cpu)
need(len(cpu_terms) == 1 and
     {e["key"] for e in cpu_terms[0]["matchExpressions"] if e["operator"] == "DoesNotExist"} == GPU_LABELS,
     "the CPU Deployment is not kept off nodes with an NVIDIA GPU label")
sel_gpu = gpu["spec"]["selector"]["matchLabels"]
sel_cpu = cpu["spec"]["selector"]["matchLabels"]
need(not (sel_gpu.items() <= cpu["spec"]["template"]["metadata"]["labels"].items()) and
     not (sel_cpu.items() <= gpu["spec"]["template"]["metadata"]["labels"].items()),
     "the worker selectors overlap (each controller would claim the other's pods)")

def container(w):
    return w["spec"]["template"]["spec"]["containers"][0]
need(":cuda" in container(gpu)["image"] or "cuda" in container(gpu)["image"],
     "the GPU DaemonSet does not run the CUDA worker image")
need("cuda" not in container(cpu)["image"], "the CPU Deployment runs a CUDA image")
need(container(gpu)["resources"]["limits"].get("nvidia.com/gpu") == 1,
     "GPU workers do not request nvidia.com/gpu: 1")
need("nvidia.com/gpu" not in container(cpu)["resources"].get("limits", {}),
     "CPU workers request a GPU")
need("--device=cpu" in container(cpu)["args"], "CPU workers do not pass --device=cpu")

for name, w in (("server", server), ("gpu worker", gpu), ("cpu worker", cpu)):
    c = container(w)
    args = " ".join(c.get("args", []) + c.get("command", []))
    for probe in ("readinessProbe", "livenessProbe"):
        need("grpc" in c.get(probe, {}), "%s: %s is not a gRPC probe" % (name, probe))
    ports = {c[p]["grpc"]["port"] for p in ("readinessProbe", "livenessProbe") if "grpc" in c.get(p, {})}
    want = "--listen=0.0.0.0:" if name == "server" else "--health-port="
    need(all(want + str(p) in args for p in ports),
         "%s: the gRPC probes' port %s is not the health service's (%s...)" % (name, ports, want))
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        need({"cpu", "memory"} <= set(res.get(kind, {})), "%s: no cpu and memory %s" % (name, kind))
    need(w["spec"]["template"]["spec"]["securityContext"].get("runAsNonRoot") is True,
         "%s: pods may run as root" % name)
    need(w["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true",
         "%s: no Prometheus scrape annotation" % name)
for p in problems:
    print("missing:", p)
sys.exit(1 if problems else 0)
PY
echo "PASS: kubernetes-validate (${#manifests[@]} manifests)"
