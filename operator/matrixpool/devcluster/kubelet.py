"""What a kubelet makes of a pod before it starts a container, for ``matrixpool sim``'s process
kubelet: the container's environment (``value`` with ``$(VAR)`` expansion, ``valueFrom``
field, Secret, ConfigMap and resource references, ``envFrom``), the files of its Secret,
ConfigMap, downward-API and projected volumes, its command line, its hostname, the
``/etc/resolv.conf`` and ``/etc/hosts`` a kubelet gives it (``dnsPolicy``, ``dnsConfig``,
``hostname``/``subdomain``, ``hostAliases``), and the mount namespace it runs in (every volume
bound at its ``mountPath``, those two files over the machine's, its hostname in a UTS namespace).

Pure functions over the pod as the API returns it (a dict, camelCase); what they need from the
API comes through a :class:`Lookup`. A reference that cannot be resolved yet (a Secret that is
missing and not optional) raises :class:`NotReadyError` with the reason a kubelet would give
(``CreateContainerConfigError``, ``FailedMount``); the pod waits, as it would on a real node.

Not done, as a kubelet would: ``subPathExpr``, ``mountPropagation``, image volumes, CSI and
other network volumes, the ``resourceFieldRef`` divisor of ``requests``/``limits`` beyond
plain integers. Containers run as the sim's user, in its root filesystem: only the volumes are
private to the pod.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

IMAGE = "matrixpool"  # the chart's image.repository: pods of this image run as processes
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")
_FIELD_KEY = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class NotReadyError(Exception):
    """The container cannot start yet; ``reason`` is what a kubelet would report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class Lookup(Protocol):
    """What the kubelet reads from the API server for a pod."""

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None: ...

    def token(
        self,
        namespace: str,
        account: str,
        audience: str | None,
        seconds: int,
        pod: tuple[str, str] | None = None,
    ) -> str:
        """A token of ``account``, bound to ``pod`` (name, UID) as a kubelet's are: valid while
        the pod lives, and carrying its node in the claims the API server reads
        (``authentication.kubernetes.io/node-name``)."""
        ...


@dataclass(frozen=True)
class Mount:
    """A volume's folder (or one file) on this machine, bound where the container sees it."""

    source: str
    target: str
    read_only: bool = False
    file: bool = False  # a single file (a subPath key, /etc/resolv.conf), not a folder


@dataclass(frozen=True)
class ClusterDNS:
    """What a kubelet's ``clusterDNS`` and ``clusterDomain`` say."""

    nameservers: tuple[str, ...]  # empty: no cluster DNS (ClusterFirst falls back to the host's)
    domain: str = "cluster.local"


MAX_NAMESERVERS = 3  # glibc reads no more; a kubelet drops the rest
MAX_SEARCHES = 32  # a kubelet's limit (validation.MaxDNSSearchPaths)
DEFAULT_OPTIONS = ("ndots:5",)  # what a kubelet gives a ClusterFirst pod
HOSTS_HEADER = "# Kubernetes-managed hosts file.\n"


def repository(image: str) -> str:
    """``reg:5000/team/matrixpool:1.2@sha256:…`` → ``reg:5000/team/matrixpool``."""
    name = image.split("@", 1)[0]
    head, sep, tail = name.rpartition(":")
    return head if sep and "/" not in tail else name


def runs_here(pod: Mapping[str, Any], image: str = IMAGE) -> bool:
    """Whether the process kubelet runs this pod: every container's image is ``image`` (any
    registry, any tag). Other pods are left to kwok, which only reports them Running."""
    containers = (pod.get("spec") or {}).get("containers") or []
    return bool(containers) and all(
        repository(c.get("image", "")).rsplit("/", 1)[-1] == image for c in containers
    )


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a variable defined earlier is replaced, ``$$`` is a
    literal ``$``, and a reference to an undefined variable is left as it is."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(one, text)


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """A downward-API ``fieldRef`` of ``pod``; a missing label or annotation is ""."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if match := _FIELD_KEY.match(path):
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        return downward_text(meta.get(path.split(".")[1]) or {})
    if path not in simple:
        raise NotReadyError("CreateContainerConfigError", f"unsupported fieldPath {path!r}")
    return str(simple[path] or "")


def downward_text(values: Mapping[str, str]) -> str:
    """Labels or annotations as a downward-API file shows them: ``key="value"`` lines, sorted,
    the value quoted (Go's %q; JSON's quoting for what our values hold)."""
    return "".join(f"{key}={json.dumps(str(values[key]))}\n" for key in sorted(values))


def _resource(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    section, _, name = str(ref.get("resource", "")).partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(section) or {}).get(name)
    if value is None and section == "requests":
        value = (resources.get("limits") or {}).get(name)
    return str(value if value is not None else 0)


def _key(lookup: Lookup, kind: str, namespace: str, ref: Mapping[str, Any]) -> str | None:
    """A Secret's or ConfigMap's key; None when it is optional and missing."""
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))
    found = (
        lookup.secret(namespace, name) if kind == "Secret" else lookup.config_map(namespace, name)
    )
    if found is None or key not in found:
        if optional:
            return None
        what = f"{kind} {namespace}/{name}" + ("" if found is None else f" has no key {key!r}")
        raise NotReadyError("CreateContainerConfigError", f"{what} not found")
    return found[key].decode()


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    lookup: Lookup,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment the container's process gets: ``base`` (the image's), then
    ``envFrom``, then ``env`` in order, each value expanded against what came before."""
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    env = dict(base or {})
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
            ref = source.get(field)
            if ref is None:
                continue
            found = (
                lookup.secret(namespace, ref.get("name", ""))
                if kind == "Secret"
                else lookup.config_map(namespace, ref.get("name", ""))
            )
            if found is None and not ref.get("optional"):
                raise NotReadyError(
                    "CreateContainerConfigError", f"{kind} {namespace}/{ref.get('name')} not found"
                )
            env.update({prefix + k: v.decode() for k, v in (found or {}).items()})
    for entry in container.get("env") or []:
        name = entry["name"]
        if "value" in entry or "valueFrom" not in entry:
            env[name] = expand(str(entry.get("value", "")), env)
            continue
        source = entry["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = _resource(container, source["resourceFieldRef"])
        elif "secretKeyRef" in source:
            value = _key(lookup, "Secret", namespace, source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            value = _key(lookup, "ConfigMap", namespace, source["configMapKeyRef"])
        else:
            raise NotReadyError("CreateContainerConfigError", f"env {name}: unsupported valueFrom")
        if value is not None:
            env[name] = value
    return env


def pre_stop_sleep(pod_spec: Mapping[str, Any]) -> float:
    """The longest ``lifecycle.preStop.sleep.seconds`` of the pod's containers (0: none)."""
    hooks = [
        ((c.get("lifecycle") or {}).get("preStop") or {}) for c in pod_spec.get("containers") or []
    ]
    return max((float((hook.get("sleep") or {}).get("seconds", 0)) for hook in hooks), default=0.0)


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args``, expanded against the container's env. (An image's own
    entrypoint is not known here: a container the sim runs must name its command.)"""
    argv = [expand(str(a), env) for a in (container.get("command") or [])]
    argv += [expand(str(a), env) for a in (container.get("args") or [])]
    if not argv:
        name = container.get("name")
        raise NotReadyError("CreateContainerConfigError", f"container {name!r} names no command")
    return argv


def _items(
    found: Mapping[str, bytes], items: Sequence[Mapping[str, Any]] | None
) -> dict[str, bytes]:
    if not items:
        return dict(found)
    return {i["path"]: found[i["key"]] for i in items if i.get("key") in found}


def volume_files(
    pod: Mapping[str, Any], volume: Mapping[str, Any], lookup: Lookup
) -> dict[str, bytes] | None:
    """The files of a Secret, ConfigMap, downward-API or projected volume (relative path →
    bytes); None for a volume that is a folder (emptyDir, hostPath)."""
    meta = pod.get("metadata") or {}
    namespace = meta.get("namespace", "default")
    if "secret" in volume or "configMap" in volume:
        kind = "Secret" if "secret" in volume else "ConfigMap"
        ref = volume.get("secret") or volume.get("configMap") or {}
        name = ref.get("secretName") if kind == "Secret" else ref.get("name")
        return _source_files(lookup, kind, namespace, name or "", ref)
    if "downwardAPI" in volume:
        return _downward_files(pod, volume["downwardAPI"].get("items") or [])
    if "projected" in volume:
        files: dict[str, bytes] = {}
        for source in volume["projected"].get("sources") or []:
            if "secret" in source:
                ref = source["secret"]
                files.update(_source_files(lookup, "Secret", namespace, ref.get("name", ""), ref))
            elif "configMap" in source:
                ref = source["configMap"]
                files.update(
                    _source_files(lookup, "ConfigMap", namespace, ref.get("name", ""), ref)
                )
            elif "downwardAPI" in source:
                files.update(_downward_files(pod, source["downwardAPI"].get("items") or []))
            elif "serviceAccountToken" in source:
                ref = source["serviceAccountToken"]
                account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
                seconds = int(ref.get("expirationSeconds") or 3607)
                meta = pod.get("metadata") or {}
                bound = (str(meta.get("name", "")), str(meta.get("uid", "")))
                token = lookup.token(
                    namespace, account, ref.get("audience"), seconds, bound if bound[1] else None
                )
                files[ref["path"]] = token.encode()
        return files
    if "emptyDir" in volume or "hostPath" in volume:
        return None
    raise NotReadyError("FailedMount", f"volume {volume.get('name')!r}: unsupported type")


def _source_files(
    lookup: Lookup, kind: str, namespace: str, name: str, ref: Mapping[str, Any]
) -> dict[str, bytes]:
    found = (
        lookup.secret(namespace, name) if kind == "Secret" else lookup.config_map(namespace, name)
    )
    if found is None:
        if ref.get("optional"):
            return {}
        raise NotReadyError("FailedMount", f"{kind} {namespace}/{name} not found")
    return _items(found, ref.get("items"))


def _downward_files(pod: Mapping[str, Any], items: Sequence[Mapping[str, Any]]) -> dict[str, bytes]:
    files = {}
    for item in items:
        if "fieldRef" in item:
            files[item["path"]] = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
    return files


STAGE = "/run/matrixpool-sim-stage"  # a mountpoint of each namespace's own (a tmpfs there)


def launcher(
    mounts: Sequence[Mount],
    argv: Sequence[str],
    image: Sequence[str] = (),
    hostname: str | None = None,
) -> list[str]:
    """The command that runs ``argv`` in a mount namespace of its own, each mount bound at its
    target (created if missing, a file for a file; read-only ones remounted so), as a container
    runtime does, and with ``hostname`` in a UTS namespace of its own. ``image`` are the
    folders that stand in for the container's image (the sim's Python installation): one that
    a mount would hide (a pod's emptyDir at /tmp over a checkout under /tmp) is bound again at
    its own path on top, as an image's files stay visible in a real container. ``unshare``
    execs, so the process keeps the launcher's pid."""
    hidden = [folder for folder in image if any(_under(folder, m.target) for m in mounts)]
    script = ["set -e"]
    if hostname is not None:
        script.append(f"hostname {shlex.quote(hostname)}")
    if hidden:  # kept aside before the mounts, on a tmpfs only this namespace sees
        script += [f"mkdir -p {STAGE}", f"mount -t tmpfs matrixpool-stage {STAGE}"]
        for index, folder in enumerate(hidden):
            script += [
                f"mkdir {STAGE}/{index}",
                f"mount --bind {shlex.quote(folder)} {STAGE}/{index}",
            ]
    for mount in _mount_order(mounts):
        target, source = shlex.quote(mount.target), shlex.quote(mount.source)
        if mount.file:
            parent = shlex.quote(mount.target.rstrip("/").rpartition("/")[0] or "/")
            script.append(f"[ -e {target} ] || {{ mkdir -p {parent} && touch {target}; }}")
        else:
            script.append(f"mkdir -p {target}")
        script.append(f"mount --bind {source} {target}")
        if mount.read_only:
            script.append(f"mount -o remount,bind,ro {target}")
    for index, folder in enumerate(hidden):
        script += [
            f"mkdir -p {shlex.quote(folder)}",
            f"mount --bind {STAGE}/{index} {shlex.quote(folder)}",
        ]
    script.append('exec "$@"')
    uts = ["--uts"] if hostname is not None else []
    return [
        "unshare",
        "--mount",
        *uts,
        "--propagation",
        "private",
        "sh",
        "-c",
        "\n".join(script),
        "sh",
        *argv,
    ]


def _under(path: str, folder: str) -> bool:
    path, folder = path.rstrip("/") + "/", folder.rstrip("/") + "/"
    return path.startswith(folder)


def _mount_order(mounts: Sequence[Mount]) -> list[Mount]:
    """Parents before what is mounted inside them; and last, a mount whose target would hide
    another's source (a pod's emptyDir at /tmp over volume folders under /tmp): a runtime
    mounts from the host's view, a shell in the new namespace sees its own mounts."""

    def key(mount: Mount) -> tuple[bool, int]:
        hides = any(_under(m.source, mount.target) for m in mounts if m is not mount)
        return hides, mount.target.rstrip("/").count("/")

    return sorted(mounts, key=key)


def hostname(pod: Mapping[str, Any], domain: str = "cluster.local") -> tuple[str, str]:
    """The pod's hostname and domain as a kubelet makes them: ``spec.hostname`` else its name,
    cut to 63 characters (no trailing ``-``/``.``); ``<subdomain>.<ns>.svc.<domain>`` when it
    has a ``spec.subdomain``, else ""."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    name = str(spec.get("hostname") or meta.get("name", ""))
    if len(name) > 63:
        name = name[:63].rstrip("-.")
    subdomain = spec.get("subdomain")
    namespace = meta.get("namespace", "default")
    return name, f"{subdomain}.{namespace}.svc.{domain}" if subdomain else ""


def uts_hostname(pod: Mapping[str, Any], domain: str = "cluster.local") -> str | None:
    """What ``hostname`` says inside the pod (``setHostnameAsFQDN``: the FQDN); None for a
    host-network pod, which keeps the machine's."""
    if (pod.get("spec") or {}).get("hostNetwork"):
        return None
    name, host_domain = hostname(pod, domain)
    fqdn = bool((pod.get("spec") or {}).get("setHostnameAsFQDN")) and host_domain
    return f"{name}.{host_domain}" if fqdn else name


def hosts_file(pod: Mapping[str, Any], node_hosts: str, domain: str = "cluster.local") -> str:
    """The pod's ``/etc/hosts``, as a kubelet writes it (managedHostsFileContent): localhost,
    the pod's own addresses with its hostname (and FQDN with a subdomain), then
    ``hostAliases``. A host-network pod gets the node's file plus its aliases."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    aliases = spec.get("hostAliases") or []
    extra = ""
    if aliases:
        extra = "\n# Entries added by HostAliases.\n" + "".join(
            str(a.get("ip", "")) + "\t" + "\t".join(a.get("hostnames") or []) + "\n"
            for a in aliases
        )
    if spec.get("hostNetwork"):
        return node_hosts + extra
    ips = [p["ip"] for p in status.get("podIPs") or [] if p.get("ip")]
    if not ips and status.get("podIP"):
        ips = [str(status["podIP"])]
    name, host_domain = hostname(pod, domain)
    lines = [
        HOSTS_HEADER,
        "127.0.0.1\tlocalhost\n",
        "::1\tlocalhost ip6-localhost ip6-loopback\n",
        "fe00::0\tip6-localnet\n",
        "fe00::0\tip6-mcastprefix\n",
        "fe00::1\tip6-allnodes\n",
        "fe00::2\tip6-allrouters\n",
    ]
    for ip in ips:
        lines.append(f"{ip}\t{name}.{host_domain}\t{name}\n" if host_domain else f"{ip}\t{name}\n")
    return "".join(lines) + extra


def parse_resolv_conf(text: str) -> tuple[list[str], list[str], list[str]]:
    """Nameservers, search domains and options of a resolv.conf (the last ``search`` wins, as
    glibc reads it)."""
    servers: list[str] = []
    searches: list[str] = []
    options: list[str] = []
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split(";", 1)[0].split()
        if not fields:
            continue
        if fields[0] == "nameserver" and len(fields) > 1:
            servers.append(fields[1])
        elif fields[0] in ("search", "domain"):
            searches = fields[1:]
        elif fields[0] == "options":
            options += fields[1:]
    return servers, searches, options


def resolv_conf(pod: Mapping[str, Any], cluster: ClusterDNS, host_resolv: str) -> str:
    """The pod's ``/etc/resolv.conf``, as a kubelet asks the runtime to write it (GetPodDNS):
    ``ClusterFirst`` (a host-network pod only with ``ClusterFirstWithHostNet``) → the cluster's
    nameservers, search ``<ns>.svc.<domain> svc.<domain> <domain>`` then the host's, options
    ``ndots:5``; ``Default`` (or no cluster DNS) → the host's; ``None`` → nothing; then
    ``spec.dnsConfig`` is merged in. Written as containerd writes it."""
    spec = pod.get("spec") or {}
    policy = spec.get("dnsPolicy") or "ClusterFirst"
    servers, searches, options = parse_resolv_conf(host_resolv)
    cluster_first = policy == "ClusterFirstWithHostNet" or (
        policy == "ClusterFirst" and not spec.get("hostNetwork")
    )
    if policy == "None":
        servers, searches, options = [], [], []
    elif cluster_first and cluster.nameservers:
        namespace = (pod.get("metadata") or {}).get("namespace", "default")
        own = [f"{namespace}.svc.{cluster.domain}", f"svc.{cluster.domain}", cluster.domain]
        servers = list(cluster.nameservers)
        searches = _unique(own + searches)
        options = list(DEFAULT_OPTIONS)
    config = spec.get("dnsConfig") or {}
    servers = _unique(servers + list(config.get("nameservers") or []))[:MAX_NAMESERVERS]
    searches = _unique(searches + list(config.get("searches") or []))[:MAX_SEARCHES]
    options = _merge_options(options, config.get("options") or [])
    text = f"search {' '.join(searches)}\n" if searches else ""
    text += "".join(f"nameserver {s}\n" for s in servers)
    return text + (f"options {' '.join(options)}\n" if options else "")


def _unique(values: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(values))


def _merge_options(base: Sequence[str], extra: Sequence[Mapping[str, Any]]) -> list[str]:
    """A pod's ``dnsConfig.options`` over the base ones, by name (mergeDNSOptions)."""
    merged = {o.partition(":")[0]: o.partition(":")[2] for o in base}
    for option in extra:
        merged[str(option.get("name", ""))] = str(option.get("value") or "")
    return [f"{name}:{value}" if value else name for name, value in merged.items()]


def encoded(data: Mapping[str, str] | None) -> dict[str, bytes] | None:
    """A Secret's ``data`` (base64) as bytes."""
    return None if data is None else {k: base64.b64decode(v) for k, v in data.items()}
