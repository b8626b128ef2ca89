"""`stallwatch check`: does this job's data reach stallwatch, and under which names?

Run beside a training job, or with its environment (the same STALLWATCH_* and launcher variables:
`torchrun --no-python ... stallwatch check`, `srun stallwatch check`), it says in plain sentences:

- who the job's processes send as: the job, rank and GPU the client reads from this environment,
  and whether the job name is one a user can find (not `unknown`, not torchrun's random run id);
- whether their events reach an agent: the socket exists and an agent is bound to it, and a probe
  sent there in the client's own wire format is counted by the agent whose /metrics `--agent.url`
  names. The probe is a batch with no events, so it changes none of the job's figures: the agent
  only learns the job's (job, rank) pair from it, as from the job's own first batch;
- whether the agent sees the job's steps and reads (its series last while the job sends);
- which spokes reads can be matched to: the spoke collectors on, whether they work, and what the
  job's reads and stalls were booked to.

Each problem comes with its fix. Exit status 0 when all is well, 1 when a problem was found.
"""

from __future__ import annotations

import argparse
import grp
import os
import re
import socket
import time
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from stallwatch import catalogue, harness
from stallwatch.client import capture, remote, wire
from stallwatch.client.identity import JOB_SOURCES, source_from_environment
from stallwatch.exporters.config import DEFAULT_PORT
from stallwatch.harness import Samples, total

DEFAULT_AGENT_URL = f"http://127.0.0.1:{DEFAULT_PORT}/metrics"
# The variable each of identity.JOB_SOURCES reads, in the same order.
JOB_SOURCE_NAMES = ("STALLWATCH_JOB", "STALLWATCH_POD_OWNER", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
# What `torchrun --standalone` makes its run id: a fresh uuid4 per launch.
RANDOM_RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
NAME_THE_JOB = "export STALLWATCH_JOB=<name> where the job is launched (docs/client.md, Identity)"
POLL_S = 0.1


@dataclass(frozen=True)
class Finding:
    """One sentence about the setup; a problem carries its fix and makes the check fail."""

    text: str
    fix: str = ""
    note: bool = False

    @property
    def problem(self) -> bool:
        return bool(self.fix)

    def line(self) -> str:
        if self.problem:
            return f"problem: {self.text}\n   fix: {self.fix}"
        return f"{'note' if self.note else 'ok'}: {self.text}"


# --- who the job sends as --------------------------------------------------------------------------------
def job_origin(env: Mapping[str, str]) -> str | None:
    """The variable the job's name comes from, or None when it is `unknown`."""
    return next((name for name, source in zip(JOB_SOURCE_NAMES, JOB_SOURCES, strict=True) if source(env)), None)


def identity(source: wire.Source, env: Mapping[str, str], explicit_job: bool) -> list[Finding]:
    gpu = source.gpu_uuid or (f"index {source.gpu}" if source.gpu >= 0 else "")
    origin = "--job" if explicit_job else job_origin(env)
    said = Finding(f"the job's processes send as training_job={source.job!r}"
                   f"{f' (from {origin})' if origin else ''}, rank {source.rank}"
                   f"{f', GPU {gpu}' if gpu else ', no GPU named'}.")
    if origin is None:
        return [said, Finding(
            "the job has no name: none of " + ", ".join(JOB_SOURCE_NAMES) + " is set (PyTorch Lightning's own "
            "launcher and plain `python train.py` set none), so its series are training_job=\"unknown\", shared "
            "with every other unnamed job on the node.", NAME_THE_JOB)]
    if origin == "TORCHELASTIC_RUN_ID" and RANDOM_RUN_ID.fullmatch(source.job):
        return [said, Finding(
            f"the job is named after torchrun's run id {source.job}, a random one per launch "
            "(`torchrun --standalone`): every launch is a new job no one can look up by name.",
            f"{NAME_THE_JOB}, or launch with `torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0 "
            "--rdzv-id=<name>` instead of --standalone, which replaces any --rdzv-id with a random one")]
    return [said]


# --- the socket and the probe ----------------------------------------------------------------------------
def socket_problem(path: str, origin: str) -> Finding | None:
    """Why a client cannot send to `path`, or None when an agent is bound there."""
    start = f"the agent's socket, {path} ({origin}),"
    fix_path = ("start the agent on this node (`stallwatch agent`, the chart's DaemonSet), or set STALLWATCH_SOCKET "
                "in the job's environment to the agent's --events.socket (in Kubernetes, mount the agent's socket "
                "directory into the pod)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(path)
        except FileNotFoundError:
            return Finding(f"{start} does not exist: the job's events go nowhere and are only counted as "
                           "dropped by the job's own processes.", fix_path)
        except ConnectionRefusedError:
            return Finding(f"{start} is a socket no agent is bound to (left by an agent that stopped): the job's "
                           "events go nowhere.", "start the agent (it replaces the stale socket), or " + fix_path)
        except PermissionError:
            return Finding(f"{start} may not be written by this user: the job's events are refused.",
                           f"run the job in the socket's group ({_group_of(path)}: the agent's --events.socket-group)"
                           " or as the agent's user")
        except OSError as error:
            return Finding(f"{start} cannot be reached: {error.strerror}.", fix_path)
    return None


def _group_of(path: str) -> str:
    gid = os.stat(path).st_gid
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def send_probe(path: str, source: wire.Source, timeout: float) -> str:
    """Send one batch of no events from `source`, in the client's wire format, to the agent at `path`; why it
    could not be sent, or "" when it was."""
    datagram = wire.encode(source, (), (), 0, 0, 0, time.monotonic_ns(), time.time_ns())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)  # a full queue (an agent that stopped reading) would block
        try:
            sock.sendto(datagram, path)
        except OSError as error:
            return error.strerror or "timed out: the agent's queue stays full"
    return ""


# --- what the agent exposes ------------------------------------------------------------------------------
class AgentUnreachableError(Exception):
    pass


def scrape(url: str, timeout: float) -> Samples:
    try:
        return harness.scrape(url, timeout)
    except urllib.error.HTTPError as error:
        raise AgentUnreachableError(f"{error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:
        raise AgentUnreachableError(str(getattr(error, "reason", error))) from error
    except ValueError as error:  # not an exposition: some other server
        raise AgentUnreachableError(f"not a metrics page ({error})") from error


def _knows(samples: Samples, source: wire.Source) -> bool:
    """Whether the agent has series for the source's (job, rank) pair."""
    return any(name == catalogue.CLIENT_DROPPED_EVENTS.name and dict(labels).get(catalogue.JOB_LABEL) == source.job
               and dict(labels).get("rank") == str(source.rank) for name, labels in samples)


def _label_values(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: value for (sample, labels), value in samples.items()
            if sample == name and label in dict(labels)}


def delivery(path: str, origin: str, url: str, source: wire.Source, timeout: float) -> tuple[list[Finding], Samples]:
    """Whether the socket takes the job's events and the agent at `url` counts them; its metrics after the probe."""
    findings = []
    stuck = socket_problem(path, origin)
    if stuck is not None:
        findings.append(stuck)
    try:
        before = scrape(url, timeout)
    except AgentUnreachableError as error:
        findings.append(Finding(f"no agent answers at {url} ({error}), so nothing here can be checked against what "
                                "it counts.", f"pass --agent.url with the agent's address (its --web.listen-address,"
                                f" port {DEFAULT_PORT} by default; in Kubernetes the node's IP), or start the agent"))
        return findings, {}
    receiving = [value for (name, _), value in before.items() if name == catalogue.RECEIVER_UP.name]
    if receiving != [1.0]:
        receiver = ("has the events collector off" if not receiving
                    else "is not bound to its events socket (another running agent holds it, or the file was removed)")
        findings.append(Finding(f"the agent at {url} {receiver}: it receives no job's events.",
                                "see the agent's log; start it with the events collector on its --events.socket"))
        return findings, before
    if stuck is not None:
        return findings, before
    unsent = send_probe(path, source, timeout)
    if unsent:
        findings.append(Finding(f"a probe could not be sent to {path} ({origin}): {unsent}.",
                                "see the agent's log: it is bound to the socket but does not take batches"))
        return findings, before
    after, deadline = before, time.monotonic() + timeout
    while not _knows(after, source) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        after = scrape(url, timeout)
    if _knows(before, source):  # the job already sends: its own batches show it, whatever becomes of the probe
        findings.append(Finding(f"the agent at {url} already counts the job's events under "
                                f"training_job={source.job!r} rank {source.rank}: they reach it."))
    elif _knows(after, source):
        findings.append(Finding(f"the agent at {url} counted a probe sent to {path} ({origin}) under "
                                f"training_job={source.job!r} rank {source.rank}: the job's events reach it."))
    if _knows(after, source):
        dropped = total(after, catalogue.CLIENT_DROPPED_EVENTS.name, **{catalogue.JOB_LABEL: source.job})
        if dropped:
            findings.append(Finding(f"the job's processes could not send {dropped:.0f} events (the agent was absent "
                                    "or slow then).", note=True))
    elif total(after, catalogue.RECEIVER_FOLDED_LABELS.name) > total(before, catalogue.RECEIVER_FOLDED_LABELS.name):
        findings.append(Finding(f"the agent at {url} folds this job into training_job=\"__other__\": it already "
                                "has as many live jobs or ranks as its limits allow.",
                                "raise the agent's --events.job-limit or --events.rank-limit"))
    else:
        findings.append(Finding(f"a probe sent to {path} ({origin}) did not reach the agent at {url} within "
                                f"{timeout:g} s: another agent is bound to that socket.",
                                "point STALLWATCH_SOCKET at the --events.socket of the agent at --agent.url, or "
                                "--agent.url at the agent that binds the socket"))
    return findings, after


# --- steps, reads and spokes ------------------------------------------------------------------------------
def _reads_by_verdict(samples: Samples, job: str) -> dict[str, float]:
    """The job's reads counted by the verdict its clients gave them."""
    return {verdict: total(samples, catalogue.DATASET_READS.name, verdict=verdict, **{catalogue.JOB_LABEL: job})
            for verdict in ("hit", "miss", "direct", "unknown")}


def reads(samples: Samples, job: str) -> list[Finding]:
    mine = {catalogue.JOB_LABEL: job}
    steps = total(samples, catalogue.LOADER_WAIT.name + "_count", **mine)
    by_verdict = _reads_by_verdict(samples, job)
    count = sum(by_verdict.values())
    if not count:
        if steps:
            return [Finding(f"the agent counts {steps:.0f} steps of job {job!r} but no read: its stalls can only be "
                            "booked `other`.", "record the dataset's reads: run the job under `stallwatch run`, which "
                            "captures them, or use open_recorded / http_get / ReadSpan in the Dataset")]
        return [Finding(f"the agent has no step or read of job {job!r} yet: run this beside the running job to see "
                        "them (a job's series last while it sends, --events.expire-after).", note=True)]
    verdicts = ", ".join(f"{verdict} {n:.0f}" for verdict, n in by_verdict.items() if n)
    findings = [Finding(f"the agent counts {steps:.0f} steps and {count:.0f} reads of job {job!r}; the reads' own "
                        f"verdicts: {verdicts} (hit/miss: the cache's answer the reader saw; direct: read through no "
                        "spoke; unknown: left to the agent).")]
    failed = total(samples, catalogue.DATASET_FAILED_READS.name, **mine)
    if failed:
        findings.append(Finding(f"{failed:.0f} of those reads got no bytes (an error reply, a read that raised: the "
                                "hub out, a spoke's miss ending in an error); while a read through a spoke fails, its "
                                "worker's back-off is booked remote_fetch (the training dashboard's Failed reads "
                                "panel).", note=True))
    return findings


def gpus(samples: Samples, source: wire.Source) -> list[Finding]:
    """Whether the job's GPU is one the agent measures."""
    uuids = {dict(labels)["gpu"]: dict(labels)["uuid"] for name, labels in samples
             if name == catalogue.GPU_INFO.name}
    if not uuids:
        return [Finding("the agent measures no GPU on this node (no NVML, or its gpu collector is off): GPU idle "
                        "seconds are not measured.", note=True)]
    if source.gpu_uuid.startswith("MIG-"):  # the agent maps a MIG device to its GPU; its id is not on the page
        return []
    if source.gpu_uuid:
        index = next((gpu for gpu, uuid in uuids.items() if uuid == source.gpu_uuid), None)
        named = source.gpu_uuid
    elif source.gpu >= 0:
        index, named = (str(source.gpu) if str(source.gpu) in uuids else None), f"index {source.gpu}"
    else:
        return [Finding("this process names no GPU (no LOCAL_RANK, CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES): "
                        "run the check with the job's environment to see which GPU its ranks send.", note=True)]
    if index is None:
        return [Finding(f"the job's GPU, {named}, is none of the {len(uuids)} GPUs the agent measures: its idle "
                        "seconds cannot be joined to the job's stalls.",
                        "run the check on the job's node with its environment; in a container, keep the "
                        "NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES the runtime sets")]
    return [Finding(f"the job's GPU, {named}, is the node's GPU {index} ({uuids[index]}), which the agent measures.")]


# Spoke collectors whose spoke reports each request, so a read is matched to the request of its key.
PER_REQUEST = {"spoke_nginx", "spoke_juicefs"}
SPOKE_SERIES = (catalogue.SPOKE_REQUESTS, catalogue.SPOKE_BYTES, catalogue.SPOKE_NFS_READ_OPERATIONS,
                catalogue.SPOKE_CACHE_SIZE)


def spokes(samples: Samples, job: str) -> list[Finding]:
    success = {collector: value for collector, value in
               _label_values(samples, catalogue.SCRAPE_COLLECTOR_SUCCESS.name, "collector").items()
               if collector.startswith("spoke_")}
    by_verdict = _reads_by_verdict(samples, job)
    unknown = by_verdict["unknown"]
    if not success:
        return [Finding("no spoke collector is on: reads without a verdict of their own are booked direct_read "
                        "(through no spoke). Right for local disks; reads that go through a cache need its "
                        "collector (--collector.spoke_nginx, spoke_juicefs, spoke_varnish, spoke_nfs, spoke_qumulo, "
                        "spoke_openmetrics: docs/spokes.md).", note=True)]
    names = sorted({name for metric in SPOKE_SERIES for name in _label_values(samples, metric.name, "spoke")})
    findings = [Finding(f"spoke collectors on: {', '.join(sorted(success))}"
                        f"{f' (spokes {names})' if names else ''}.")]
    for collector, up in sorted(success.items()):
        if up != 1:
            findings.append(Finding(f"the {collector} collector fails: its spoke's counters are missing and reads "
                                    "cannot be matched to its requests.",
                                    f"see the agent's log and stallwatch_spoke_collector_errors_total; check the "
                                    f"--{collector}.* flags"))
    if by_verdict["direct"] and not (unknown or by_verdict["hit"] or by_verdict["miss"]):
        findings.append(Finding(
            f"every read of job {job!r} so far ({by_verdict['direct']:.0f}) crossed no spoke, by the client's own "
            "account: its stalls on reads are booked direct_read, none remote_fetch. Right if the job reads a local "
            "disk; if it reads through the spoke, tell the client where the spoke is: `stallwatch run --spoke-url "
            f"URL` or `--spoke-mount PATH` (${remote.SPOKE_URLS_ENV}, ${capture.SPOKE_MOUNTS_ENV}).", note=True))
    if unknown:
        how = ("matched to the logged request of the same key, else classed hit or miss by their latency"
               if PER_REQUEST & success.keys() else "classed hit or miss by their latency (these spokes log no "
               "requests to match a read to)")
        findings.append(Finding(f"{unknown:.0f} reads of job {job!r} came without a verdict: they are {how}."))
    stalls = {cause: total(samples, catalogue.STALL_SECONDS.name, cause=cause, **{catalogue.JOB_LABEL: job})
              for cause in catalogue.CAUSES}
    if any(stalls.values()):
        findings.append(Finding(f"stalls of job {job!r} so far, by cause: " + ", ".join(
            f"{cause} {seconds:.1f} s" for cause, seconds in stalls.items() if seconds) + "."))
    return findings


# --- the command -----------------------------------------------------------------------------------------
def run(options: argparse.Namespace, env: Mapping[str, str], out: Callable[[str], None]) -> int:
    source = source_from_environment(job=options.job, env=env)
    if options.socket:
        path, origin = options.socket, "--socket"
    elif env.get(wire.SOCKET_ENV):
        path, origin = env[wire.SOCKET_ENV], wire.SOCKET_ENV
    else:
        path, origin = wire.DEFAULT_SOCKET, f"the default: {wire.SOCKET_ENV} is not set"
    findings = identity(source, env, options.job is not None)
    delivered, samples = delivery(path, origin, options.agent_url, source, options.timeout)
    findings += delivered
    if samples:
        findings += gpus(samples, source) + reads(samples, source.job) + spokes(samples, source.job)
    for finding in findings:
        out(finding.line())
    problems = sum(finding.problem for finding in findings)
    out("all is well." if not problems else f"{problems} problem{'s' if problems > 1 else ''} found.")
    return 1 if problems else 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="stallwatch check", description=__doc__.splitlines()[0])
    parser.add_argument("--agent.url", dest="agent_url", default=DEFAULT_AGENT_URL,
                        help="the node agent's metrics page (default: %(default)s)")
    parser.add_argument("--socket", default=None, help=f"the events socket (default: ${wire.SOCKET_ENV}, "
                        f"else {wire.DEFAULT_SOCKET}, as the client chooses)")
    parser.add_argument("--job", default=None, help="the job name the code passes the client itself (job=...), "
                        "if it does")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent "
                        "(default: %(default)s)")
    return run(parser.parse_args(argv), os.environ, print)

