#!/usr/bin/env bash
# kubernetes-validate (PyPI) --strict on every manifest in deploy/k8s/, against
# the Kubernetes schemas it ships, and the pieces the deployment relies on:
# the server StatefulSet behind a headless Service and covered by a
# PodDisruptionBudget; workers in two flavours chosen by the nodes' NVIDIA GPU
# label (a DaemonSet on the CUDA image requesting nvidia.com/gpu where the
# label exists, a Deployment on the CPU image where it does not) with
# selectors that cannot claim each other's pods; gRPC readiness and liveness
# probes on the plaintext health ports (never on the TLS port); resource
# requests and limits on every container; non-root pods; Prometheus scrape
# annotations. Security (issue 8): every daemon runs with TLS and its token
# file (the server with mTLS, every daemon's /metrics wanting a client
# certificate), its own Secret mounted read-only at
# /etc/pstrain/certs with every file its flags name, no Secret in the repo
# carries data, nothing but a health port binds 0.0.0.0 without TLS, no
# --insecure; the NetworkPolicies deny by default, allow the paths pstrain
# needs and block a list of others (evaluated below, ingress and egress);
# Prometheus scrapes https against the CA under each daemon's certificate
# name with its own client certificate (its only Secret), and its plaintext
# UI listens on loopback only.
# Usage: k8s_validate_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source "$(dirname "$0")/lib.sh"
SRC=$1
VALIDATE=$(find_tool kubernetes-validate "$2")
shopt -s nullglob
manifests=("$SRC"/deploy/k8s/*.yaml)
((${#manifests[@]} >= 8)) || fail "expected at least 8 manifests in deploy/k8s, found ${#manifests[@]}"
"$VALIDATE" --strict --quiet "${manifests[@]}"
python3 - "${manifests[@]}" <<'PY' || fail "deploy/k8s lacks a required piece (above)"
import re, sys
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
             "Service", "PodDisruptionBudget", "NetworkPolicy"):
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
    need(ports and all("--health-port=%d" % p in args for p in ports),
         "%s: the gRPC probes' port %s is not --health-port's" % (name, ports))
    need(not any(re.search(r"--listen=[^ ]*:%d\b" % p, args) for p in ports),
         "%s: a gRPC probe targets the TLS --listen port (probes cannot speak TLS)" % name)
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        need({"cpu", "memory"} <= set(res.get(kind, {})), "%s: no cpu and memory %s" % (name, kind))
    need(w["spec"]["template"]["spec"]["securityContext"].get("runAsNonRoot") is True,
         "%s: pods may run as root" % name)
    need(w["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true",
         "%s: no Prometheus scrape annotation" % name)
# --- Security (issue 8 part 6) ---------------------------------------------
CERTS = "/etc/pstrain/certs"
SECRET_KEYS = {
    "pstrain-server-credentials": {"ca.pem", "server.pem", "server-key.pem", "tokens"},
    "pstrain-worker-credentials": {"ca.pem", "worker.pem", "worker-key.pem", "worker.token"},
    "pstrain-admin-credentials": {"ca.pem", "admin.pem", "admin-key.pem", "admin.token"},
    "pstrain-prometheus-credentials": {"prometheus.pem", "prometheus-key.pem"},
}
secrets = by_kind.get("Secret", {})
for secret in SECRET_KEYS:
    need(secret in secrets, "no Secret %s" % secret)
for name, secret in secrets.items():
    need(not secret.get("data") and not secret.get("stringData"),
         "Secret %s carries data: keys never go into the repository (secret.yaml says how "
         "to create them)" % name)

def pod_spec(w):
    return w["spec"]["template"]["spec"]

def flag_values(args):
    # --name=value and bare --name, from args lists or a shell command line.
    found = {}
    for m in re.finditer(r"(?<!\S)--([a-z][a-z0-9-]*)(?:=(\S*))?", args):
        found.setdefault(m.group(1), []).append(m.group(2))
    return found

WANT_FLAGS = {
    "server": {"tls-cert": "server.pem", "tls-key": "server-key.pem", "tls-ca": "ca.pem",
               "token-file": "tokens"},
    "gpu worker": {"tls-cert": "worker.pem", "tls-key": "worker-key.pem", "tls-ca": "ca.pem",
                   "token-file": "worker.token"},
    "cpu worker": {"tls-cert": "worker.pem", "tls-key": "worker-key.pem", "tls-ca": "ca.pem",
                   "token-file": "worker.token"},
}
WANT_SECRET = {"server": "pstrain-server-credentials", "gpu worker": "pstrain-worker-credentials",
               "cpu worker": "pstrain-worker-credentials"}
for name, w in (("server", server), ("gpu worker", gpu), ("cpu worker", cpu)):
    c = container(w)
    args = " ".join(c.get("command", []) + c.get("args", []))
    flags = flag_values(args)
    for flag, file in WANT_FLAGS[name].items():
        need(flags.get(flag) == ["%s/%s" % (CERTS, file)],
             "%s: does not pass --%s=%s/%s" % (name, flag, CERTS, file))
    # mTLS on the server's port; client certificates on every /metrics.
    need("require-client-cert" in flags, "%s: no --require-client-cert" % name)
    need("insecure" not in flags, "%s: runs with --insecure" % name)
    # Nothing binds every address without TLS; the plaintext health port
    # serves grpc.health.v1.Health only, which the kubelet's probes need.
    for flag, values in flags.items():
        for v in values:
            if v and v.split(":")[0] in ("0.0.0.0", "[::]", "::") and flag != "health-host":
                need("tls-cert" in flags and "tls-key" in flags,
                     "%s: --%s=%s without TLS" % (name, flag, v))
    # The Secret: mounted read-only at CERTS, group-readable only, with every
    # file the flags name (a missing key stops the pod at mount time).
    mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == CERTS]
    need(len(mounts) == 1 and mounts[0].get("readOnly") is True,
         "%s: %s is not mounted read-only" % (name, CERTS))
    volumes = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
    vol = volumes.get(mounts[0]["name"], {}) if mounts else {}
    sec = vol.get("secret", {})
    need(sec.get("secretName") == WANT_SECRET[name],
         "%s: %s does not come from the Secret %s" % (name, CERTS, WANT_SECRET[name]))
    need(sec.get("defaultMode") == 0o440, "%s: the credentials are not mode 0440" % name)
    need(pod_spec(w)["securityContext"].get("fsGroup") == 10001,
         "%s: no fsGroup 10001 (uid 10001 could not read the 0440 files)" % name)
    items = {i["path"]: i["key"] for i in sec.get("items", [])}
    need(set(items.values()) <= SECRET_KEYS.get(WANT_SECRET[name], set()),
         "%s: mounts keys that are not its Secret's: %s" % (name, sorted(items.values())))
    named = {v[len(CERTS) + 1:] for vs in flags.values() for v in vs
             if v and v.startswith(CERTS + "/")}
    need(named <= set(items), "%s: flags name %s, the mount has %s" %
         (name, sorted(named), sorted(items)))

# Prometheus: https against the CA (from a ConfigMap), one server_name per
# daemon kind, with its client certificate and key from its own Secret (the
# only one in its pod).
prom = by_kind.get("Deployment", {}).get("prometheus")
cm = by_kind["ConfigMap"].get("prometheus-config", {}).get("data", {})
need(prom is not None and "prometheus.yml" in cm, "the Prometheus Deployment and its config")
if prom is not None and "prometheus.yml" in cm:
    pc = container(prom)
    need(any(a.startswith("--web.listen-address=127.0.0.1:") for a in pc.get("args", [])),
         "Prometheus' UI (no TLS) does not listen on loopback only")
    pvolumes = {v["name"]: v for v in pod_spec(prom).get("volumes", [])}
    psecrets = [v["secret"] for v in pvolumes.values() if "secret" in v]
    need([x.get("secretName") for x in psecrets] == ["pstrain-prometheus-credentials"],
         "Prometheus mounts Secrets %s, not pstrain-prometheus-credentials alone" %
         [x.get("secretName") for x in psecrets])
    need(all(x.get("defaultMode") == 0o440 for x in psecrets),
         "Prometheus' client key is not mode 0440")

    def mounted_from(path):
        # The volume item a file path of Prometheus' container comes from.
        mounts = [m for m in pc.get("volumeMounts", [])
                  if path.startswith(m["mountPath"].rstrip("/") + "/")]
        if not mounts:
            return None, None
        vol = pvolumes.get(mounts[-1]["name"], {})
        source = vol.get("configMap") or vol.get("secret") or {}
        key = {i["path"]: i["key"] for i in source.get("items", [])}.get(
            path[len(mounts[-1]["mountPath"]):].lstrip("/"))
        return source.get("name") or source.get("secretName"), key
    config = yaml.safe_load(cm["prometheus.yml"])
    jobs = {j["job_name"]: j for j in config.get("scrape_configs", [])}
    need(set(jobs) == {"pstrain-server", "pstrain-worker"},
         "Prometheus' scrape jobs are %s, not pstrain-server and pstrain-worker" % sorted(jobs))
    for job_name, job in jobs.items():
        tls = job.get("tls_config", {})
        need(job.get("scheme") == "https", "Prometheus job %s does not scrape https" % job_name)
        need(tls.get("server_name") == job_name,
             "Prometheus job %s: tls_config.server_name is not %s" % (job_name, job_name))
        need(not tls.get("insecure_skip_verify"), "Prometheus job %s skips verification" % job_name)
        keeps = [r for r in job.get("relabel_configs", []) if r.get("action") == "keep" and
                 r.get("source_labels") == ["__meta_kubernetes_pod_label_app_kubernetes_io_name"]]
        need(len(keeps) == 1 and keeps[0].get("regex") == job_name,
             "Prometheus job %s does not keep only the %s pods" % (job_name, job_name))
        for field, want in (("ca_file", ("pstrain-ca", "ca.pem")),
                            ("cert_file", ("pstrain-prometheus-credentials", "prometheus.pem")),
                            ("key_file",
                             ("pstrain-prometheus-credentials", "prometheus-key.pem"))):
            need(mounted_from(tls.get(field, "")) == want,
                 "Prometheus job %s: %s %s is not %s of %s" %
                 (job_name, field, tls.get(field), want[1], want[0]))
need("pstrain-ca" in by_kind["ConfigMap"], "no ConfigMap pstrain-ca (the CA for Prometheus)")
need(not by_kind["ConfigMap"].get("pstrain-ca", {}).get("data"),
     "ConfigMap pstrain-ca carries data: it is made from make-certs.sh's ca.pem")

# NetworkPolicies: evaluate them the way the API defines (a connection passes
# when the destination's ingress and the source's egress both allow it; a pod
# no policy of a direction selects is open in that direction).
policies = list(by_kind.get("NetworkPolicy", {}).values())
need(any(p["spec"].get("podSelector") == {} and
         {"Ingress", "Egress"} <= set(p["spec"].get("policyTypes", [])) and
         not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies),
     "no default-deny NetworkPolicy (podSelector {}, Ingress and Egress, no rules)")

def selects(selector, labels):
    if labels is None:
        return False
    for k, v in selector.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]: return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]: return False
        if e["operator"] == "Exists" and not have: return False
        if e["operator"] == "DoesNotExist" and have: return False
    return True

def types(p):
    t = p["spec"].get("policyTypes")
    if t: return t
    return ["Ingress"] + (["Egress"] if "egress" in p["spec"] else [])

def peer_matches(peer, labels, namespace):
    if "ipBlock" in peer:
        return namespace is None  # outside the cluster's pods
    if "namespaceSelector" in peer:
        return namespace is not None  # a coarse reading: some namespace
    return namespace == "pstrain" and selects(peer.get("podSelector", {}), labels)

def port_matches(rule, port, protocol):
    ports = rule.get("ports")
    return not ports or any(p.get("protocol", "TCP") == protocol and
                            p.get("port") in (None, port) for p in ports)

def allowed(direction, pod, peer, peer_ns, port, protocol):
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if direction in types(p)
                 and selects(p["spec"]["podSelector"], pod)]
    if not selecting:
        return True
    return any((not rule.get(peers_key) or any(peer_matches(x, peer, peer_ns)
                                               for x in rule[peers_key]))
               and port_matches(rule, port, protocol)
               for p in selecting for rule in p["spec"].get(key, []))

def path_open(src, dst, port, dst_ns="pstrain", protocol="TCP"):
    return (allowed("Egress", src, dst, dst_ns, port, protocol) and
            (dst_ns != "pstrain" or allowed("Ingress", dst, src, "pstrain", port, protocol)))

pods = {
    "server": server["spec"]["template"]["metadata"]["labels"],
    "gpu worker": gpu["spec"]["template"]["metadata"]["labels"],
    "cpu worker": cpu["spec"]["template"]["metadata"]["labels"],
    "cli": {"app.kubernetes.io/name": "pstrain-cli"},
    "prometheus": prom["spec"]["template"]["metadata"]["labels"] if prom else {},
    "other pod": {"app.kubernetes.io/name": "something-else"},
}
OPEN = [("gpu worker", "server", 7070), ("cpu worker", "server", 7070), ("cli", "server", 7070),
        ("server", "server", 7070), ("prometheus", "server", 9100),
        ("prometheus", "gpu worker", 9101), ("prometheus", "cpu worker", 9101)]
CLOSED = [("other pod", "server", 7070), ("cpu worker", "server", 9100),
          ("cli", "cpu worker", 9101), ("cpu worker", "gpu worker", 9101),
          ("other pod", "server", 7071), ("other pod", "cpu worker", 9102),
          ("cli", "prometheus", 9090), ("server", "cpu worker", 9101),
          ("prometheus", "server", 7070), ("prometheus", "cpu worker", 9102)]
for src, dst, port in OPEN:
    need(path_open(pods[src], pods[dst], port),
         "the NetworkPolicies block %s -> %s:%d" % (src, dst, port))
for src, dst, port in CLOSED:
    need(not path_open(pods[src], pods[dst], port),
         "the NetworkPolicies let %s reach %s:%d" % (src, dst, port))
for src in ("server", "gpu worker", "cpu worker", "cli", "prometheus"):
    need(path_open(pods[src], None, 53, dst_ns="kube-system", protocol="UDP"),
         "the NetworkPolicies block DNS from %s" % src)
for src in ("server", "cpu worker", "cli"):
    need(not path_open(pods[src], None, 443, dst_ns=None),
         "the NetworkPolicies let %s reach addresses outside the cluster" % src)

for p in problems:
    print("missing:", p)
sys.exit(1 if problems else 0)
PY
echo "PASS: kubernetes-validate (${#manifests[@]} manifests)"
