"""Fuzz every operation of the HTTP API (schemathesis, from the server's /openapi.json).

    python benchmarks/fuzz_api.py                        # 4000 cases, starts its own server
    python benchmarks/fuzz_api.py --cases 300 --json     # a quicker run
    python benchmarks/fuzz_api.py --url http://127.0.0.1:30000
    python benchmarks/fuzz_api.py --smoke                # one case per operation and mode

Starts `genserve serve` on loopback (embedded SmolLM2 with a short context, the demo diffusion
models) unless --url is given, then sends each operation valid (positive) and invalid
(negative) requests generated from its schema, sequentially. It counts responses by status and
reports as failures: any 5xx, any request without an answer within --request-timeout (a hang),
and, at the end, a server whose /health is not 200, whose runtimes restarted, or whose pools
fail their integrity checks (`/get_server_info`). Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from genserve.bench.server_process import ROBUSTNESS_FLAGS, server_problems


@dataclass
class FuzzReport:
    cases: int = 0
    seconds: float = 0.0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_operation: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    hangs: list[dict[str, Any]] = field(default_factory=list)
    integrity: list[str] = field(default_factory=list)  # problems found after the run
    not_generated: list[str] = field(default_factory=list)  # operation (mode) with no case

    @property
    def ok(self) -> bool:
        return not (self.server_errors or self.hangs or self.integrity)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases, "seconds": round(self.seconds, 1),
            "responses_5xx": len(self.server_errors), "hangs": len(self.hangs),
            "integrity_problems": self.integrity,
            "by_status": dict(sorted(self.by_status.items())),
            "operations": len(self.by_operation), "not_generated": self.not_generated,
            "server_errors": self.server_errors[:20], "hang_examples": self.hangs[:20],
        }


def fuzz(url: str, cases_per_operation: int, request_timeout: float = 60.0,
         time_budget_s: float | None = None, seed: int = 0) -> FuzzReport:
    """Run the fuzzer against a running server (loopback): `cases_per_operation` examples per
    operation and generation mode, within `time_budget_s` in all when given."""
    import hypothesis
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    report = FuzzReport()
    start = time.monotonic()
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # Each operation and mode gets an equal share of the budget: every one is exercised.
    share = time_budget_s / len(operations) if time_budget_s else float("inf")
    deadline = float("inf")
    session = requests.Session()

    def send(case: Any) -> None:
        if time.monotonic() > deadline:
            return
        label = f"{case.method.upper()} {case.operation.path}"
        report.cases += 1
        report.by_operation[label] += 1
        sent = time.monotonic()
        try:
            response = case.call(base_url=url, session=session, timeout=request_timeout)
        except requests.Timeout:
            report.hangs.append({"operation": label, "curl": case.as_curl_command()})
            return
        except requests.ConnectionError as exc:  # the server dropped the connection
            report.server_errors.append({"operation": label, "status": None,
                                         "error": str(exc)[:300],
                                         "curl": case.as_curl_command()[:2000]})
            return
        report.by_status[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append({
                "operation": label, "status": response.status_code,
                "body": response.text[:500], "seconds": round(time.monotonic() - sent, 2),
                "curl": case.as_curl_command()[:2000]})

    for i, operation in enumerate(operations):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            deadline = time.monotonic() + share / 2
            strategy = operation.as_strategy(generation_mode=mode)
            # Failures are recorded, never raised: hypothesis must not shrink or stop early.
            run = hypothesis.given(case=strategy)(send)
            run = hypothesis.settings(
                max_examples=cases_per_operation, deadline=None, database=None,
                phases=[hypothesis.Phase.generate],
                suppress_health_check=list(hypothesis.HealthCheck))(run)
            try:
                hypothesis.seed(seed + 2 * i + (mode == GenerationMode.NEGATIVE))(run)()
            except hypothesis.errors.Unsatisfiable:
                # No invalid input exists (an operation without parameters or body).
                report.not_generated.append(f"{operation.label} ({mode.value})")
    report.seconds = time.monotonic() - start
    report.integrity = server_problems(url)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="Fuzz this running server instead (loopback).")
    p.add_argument("--cases", type=int, default=4000, help="Total cases, spread over operations.")
    p.add_argument("--time-budget", type=float, default=1800.0, help="Seconds, at most.")
    p.add_argument("--request-timeout", type=float, default=60.0,
                   help="A request unanswered after this many seconds counts as a hang.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="one positive and one negative case per operation: checks the script")
    args = p.parse_args()
    if args.smoke:
        args.cases = 1  # per_operation is at least 1

    def run(url: str) -> FuzzReport:
        import schemathesis

        count = len(list(schemathesis.openapi.from_url(url + "/openapi.json")
                         .get_all_operations()))
        per_operation = max(1, args.cases // (2 * count))  # positive + negative
        return fuzz(url, per_operation, args.request_timeout, args.time_budget, args.seed)

    if args.url:
        report = run(args.url)
    else:
        from genserve.bench.server_process import serve

        with serve(*ROBUSTNESS_FLAGS) as server:
            report = run(server.url)
    result = report.to_dict()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{result['cases']} cases over {result['operations']} operations in "
              f"{result['seconds']} s: {result['responses_5xx']} responses 5xx, "
              f"{result['hangs']} hangs, integrity: {report.integrity or 'intact'}")
        print("by status:", result["by_status"])
        for error in result["server_errors"][:5]:
            print("5xx:", json.dumps(error)[:1000])
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
