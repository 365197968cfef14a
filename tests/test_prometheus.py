"""The Prometheus endpoint (``observe.prometheus_port``) scraped by a real Prometheus, and the shipped rules.

* A 2-rank run (gloo, a tiny GPT, 6 steps, rank 1 made 5x slower with ``fault.slow_rank``) serves one endpoint
  per rank (port + rank). A Prometheus server (Debian's ``prometheus`` package, started here on loopback,
  scraping both endpoints every 200 ms) is queried over its HTTP API before the run ends: ``plait_loss`` per rank
  equals the loss each rank computed at its last step, ``plait_straggler_score`` per rank equals the trainer's
  straggler score (rank 1 above ``plait_straggler_factor``, rank 0 below), and every metric the exporter
  declares is there for both ranks with the labels job, rank and host.
* ``promtool check rules docs/monitoring/*.yml`` accepts the alerting rules, and ``promtool test rules`` fires
  each alert on synthetic series exactly when its rule says (and not before).
* The Grafana dashboard and the rules query only metric names the endpoint serves.

Skipped, with the reason, where the ``prometheus`` package cannot be installed.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from helpers import free_port, run_ranks
from sysdeps import ensure_debian, which

from plait.observe.prometheus import METRICS

MONITORING = Path(__file__).resolve().parents[1] / "docs" / "monitoring"
pytest.importorskip("prometheus_client")


@pytest.fixture(scope="module")
def prometheus() -> None:
    reason = ensure_debian(["prometheus"], ["prometheus", "promtool"])
    if reason is not None:
        pytest.skip(reason)


def _query(url: str, q: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': q})}", timeout=10) as r:
        return json.load(r)["data"]["result"]


def _by_rank(url: str, q: str) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in _query(url, q)}


def _observed(url: str, job: str) -> dict:
    """Rank 0, once every rank's last step is done: wait for a scrape after now, then read both ranks."""
    since, deadline = time.time(), time.time() + 30
    while time.time() < deadline:
        seen = _by_rank(url, f'timestamp(plait_straggler_score{{job="{job}"}})')
        if len(seen) == 2 and min(seen.values()) > since:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"Prometheus did not scrape both ranks within 30 s (last seen: {seen})")
    names: dict[str, set] = {}
    for r in _query(url, f'{{job="{job}", __name__=~"plait_.+"}}'):
        names.setdefault(r["metric"]["__name__"], set()).add((r["metric"]["rank"], r["metric"]["host"]))
    return {"loss": _by_rank(url, f'plait_loss{{job="{job}"}}'),
            "straggler": _by_rank(url, f'plait_straggler_score{{job="{job}"}}'),
            "factor": _by_rank(url, f'plait_straggler_factor{{job="{job}"}}'),
            "step": _by_rank(url, f'plait_step{{job="{job}"}}'),
            "interval": _by_rank(url, f'plait_checkpoint_interval_steps{{job="{job}"}}'),
            "running": _by_rank(url, f'sum by (rank) (plait_watchdog_state{{job="{job}", state!="off"}})'),
            "names": names}


def _worker(rank: int, world: int, run_dir: str, port: int, url: str) -> dict:
    from plait.config import from_sections
    from plait.recipes import build_trainer
    from plait.train.trainer import Trainer

    class Held(Trainer):
        """Keeps each rank's own last loss, and holds the endpoints open until Prometheus has read them."""

        def train_step(self) -> dict:
            rec = super().train_step()
            self.own_loss = rec["loss"]
            return rec

        def finish(self) -> dict:
            self.p.barrier()  # every rank's gauges hold the last step
            self.seen = _observed(url, Path(run_dir).name) if self.rank0 else None
            self.p.barrier()
            return super().finish()

    cfg = from_sections({
        "run": {"dir": run_dir}, "model": {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 32},
        "train": {"steps": 6, "global_batch_size": 8, "micro_batch_size": 2, "eval_every": 0, "eval_sequences": 8,
                  "log_every": 1},
        "checkpoint": {"every": 3}, "fault": {"slow_rank": 1, "slow_factor": 5.0},
        "observe": {"progress": False, "trackers": [], "prometheus_port": port}})
    trainer = build_trainer(cfg, Held)
    trainer.fit()
    return {"loss": trainer.own_loss, "scores": trainer.recovery.stragglers.scores, "seen": trainer.seen}


def _two_free_ports() -> int:
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_prometheus_scrapes_every_rank(tmp_path: Path, prometheus: None) -> None:
    port, web = _two_free_ports(), free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "200ms", "scrape_timeout": "200ms"},
        # honor_labels: the endpoint's own job label (the run) stays; Prometheus's would replace it
        "scrape_configs": [{"job_name": "plait", "honor_labels": True,
                            "static_configs": [{"targets": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]}]}]}))
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115
    server = subprocess.Popen([which("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{web}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/-/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        results = run_ranks(_worker, 2, str(tmp_path / "promrun"), port, url, timeout=180)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    seen = results[0]["seen"]
    for r, out in enumerate(results):
        assert seen["loss"][str(r)] == out["loss"], (r, seen["loss"], out["loss"])
        assert seen["straggler"][str(r)] == round(out["scores"][r], 3)
        assert seen["step"][str(r)] == 6 and seen["interval"][str(r)] == 3 and seen["running"][str(r)] == 1
    assert seen["straggler"]["1"] > seen["factor"]["1"] == 1.3 > seen["straggler"]["0"]
    assert seen["loss"]["0"] != seen["loss"]["1"]  # each rank's own micro-batches, not the mean
    host = socket.gethostname()
    for name in METRICS:
        assert seen["names"].get(name) == {("0", host), ("1", host)}, name


def test_rules_pass_promtool(prometheus: None) -> None:
    files = sorted(str(p) for p in MONITORING.glob("*.yml"))
    assert files
    done = subprocess.run([which("promtool"), "check", "rules", *files], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _annotations(rules: dict, alert: str, labels: dict[str, str]) -> dict[str, str]:
    rule = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == alert)
    return {k: re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], v)
            for k, v in rule["annotations"].items()}


def _alert(rules: dict, alert: str, at: str, fired: list[dict[str, str]]) -> dict:
    return {"eval_time": at, "alertname": alert, "exp_alerts": [
        {"exp_labels": labels, "exp_annotations": _annotations(rules, alert, labels)} for labels in fired]}


def test_alerts_fire_when_their_rules_say(tmp_path: Path, prometheus: None) -> None:
    path = MONITORING / "plait-alerts.yml"
    rules = yaml.safe_load(path.read_text())

    def labels(rank: str, severity: str) -> dict[str, str]:
        return {"job": "j", "rank": rank, "host": "h", "severity": severity}

    def s(name: str, rank: str, values: str) -> dict:
        return {"series": f'{name}{{job="j",rank="{rank}",host="h"}}', "values": values}

    loss = [s("plait_loss", "0", "2.5 2.4 NaN NaN"), s("plait_loss", "1", "2.5 2.4 2.3 +Inf")]
    # rank 0's last step at 60 s, 1 s steps: 120 s without a step at 3m (not more than the 2-minute floor), more
    # from then on, firing after `for: 1m`; rank 1 steps every minute
    stuck = [s("plait_last_step_timestamp_seconds", "0", "0 60x10"),
             s("plait_last_step_timestamp_seconds", "1", "0+60x10"),
             s("plait_step_seconds", "0", "1x10"), s("plait_step_seconds", "1", "1x10")]
    slow = [s("plait_straggler_score", "0", "0.5x10"), s("plait_straggler_score", "1", "1.5x10"),
            s("plait_straggler_factor", "0", "1.3x10"), s("plait_straggler_factor", "1", "1.3x10")]
    restarts = [s("plait_restarts", "0", "0 0 1 1 2 2"), s("plait_restarts", "1", "0 0 1 1 2 2")]
    # 100-step interval of 1 s steps: older than 150 s from 3m on, firing after `for: 5m`; rank 1 saves only at the
    # end (interval 0) and never fires
    stale = [s("plait_checkpoint_age_seconds", "0", "0+60x10"), s("plait_checkpoint_age_seconds", "1", "0+60x10"),
             s("plait_checkpoint_interval_steps", "0", "100x10"), s("plait_checkpoint_interval_steps", "1", "0x10"),
             s("plait_step_seconds", "0", "1x10"), s("plait_step_seconds", "1", "1x10")]
    tests = [
        {"interval": "1m", "input_series": loss, "alert_rule_test": [
            _alert(rules, "PlaitLossNotFinite", "1m", []),
            _alert(rules, "PlaitLossNotFinite", "2m", [labels("0", "critical")]),
            _alert(rules, "PlaitLossNotFinite", "3m", [labels("0", "critical"), labels("1", "critical")])]},
        {"interval": "1m", "input_series": stuck, "alert_rule_test": [
            _alert(rules, "PlaitNoProgress", "4m", []),
            _alert(rules, "PlaitNoProgress", "5m", [labels("0", "critical")])]},
        {"interval": "1m", "input_series": slow, "alert_rule_test": [
            _alert(rules, "PlaitStraggler", "4m", []),
            _alert(rules, "PlaitStraggler", "5m", [labels("1", "warning")])]},
        {"interval": "1m", "input_series": restarts, "alert_rule_test": [
            _alert(rules, "PlaitRestartLoop", "3m", []),
            _alert(rules, "PlaitRestartLoop", "4m", [{"job": "j", "severity": "critical"}])]},
        {"interval": "1m", "input_series": stale, "alert_rule_test": [
            _alert(rules, "PlaitCheckpointStale", "7m", []),
            _alert(rules, "PlaitCheckpointStale", "8m", [labels("0", "warning")])]},
    ]
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(path)], "evaluation_interval": "1m", "tests": tests}))
    done = subprocess.run([which("promtool"), "test", "rules", str(spec)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} == {t["alert_rule_test"][0]["alertname"]
                                                                         for t in tests}


def test_dashboard_and_rules_use_served_names() -> None:
    dashboard = json.loads((MONITORING / "plait-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in yaml.safe_load((MONITORING / "plait-alerts.yml").read_text())["groups"]
              for r in g["rules"]]
    used = {name for e in exprs for name in re.findall(r"\bplait_\w+", e)}
    assert used and used <= set(METRICS), used - set(METRICS)
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_bad_endpoint_settings_are_one_line(tmp_path: Path, monkeypatch) -> None:
    """A port another process holds, a port out of range, prometheus_client missing: a ConfigError each, naming
    what to change."""
    import plait
    from plait.config import ConfigError

    def build(port: int) -> None:
        plait.Plait(run={"dir": str(tmp_path)}, observe={"progress": False, "trackers": [], "prometheus_port": port})

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"rank 0 cannot serve metrics on 127.0.0.1:{port} .*choose another "
                                              "observe.prometheus_port"):
            build(port)
    with pytest.raises(ConfigError, match="observe.prometheus_port must be a TCP port"):
        build(70000)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match=r"prometheus-client package is not installed: pip install "
                                          r"'plait\[prometheus\]'"):
        build(9400)
