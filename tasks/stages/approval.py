"""A person's approval between the gate and publish (`publish.approval: required`): what they are shown,
and what their answer means for the run note and the published version's audit trail.

The retrain DAG asks through Airflow's human-in-the-loop operator; this module knows nothing of Airflow:
it builds the request's markdown from the run's own facts (the candidate's metrics, the gate's rule
results, the live version) and turns the answer (who, which option, their comment) into the run note of
a rejection or the actor and reason publish records for an approval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tasks.base.audit import via
from tasks.base.errors import RetrainerError
from tasks.config.duration import format_duration

if TYPE_CHECKING:
    from tasks.registry import VersionRecord
    from tasks.runs.identity import RunIdentity

MAX_COMMENT = 1000  # characters of the person's comment kept in notes and reasons


def _code(text: object) -> str:
    """Inline code in markdown (a value that might hold markdown characters shows as written)."""
    return "`" + str(text).replace("`", "'") + "`"


def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _change(new: Any, old: Any) -> str:
    if not isinstance(new, int | float) or not isinstance(old, int | float):
        return ""
    delta = new - old
    relative = f" ({delta / abs(old):+.2%})" if old else ""
    return f"{delta:+.6g}{relative}"


def request_subject(model: str, alias: str) -> str:
    return f"Publish the new {model} to {alias}?"


def request_body(model: str, alias: str, run: RunIdentity, metrics: dict[str, Any], gate: dict[str, Any],
                 live: VersionRecord | None, timeout_s: float) -> str:
    """The markdown a person reads before approving: the candidate, its numbers next to the live version's
    (both scored on the same suites by this run's evaluate), every gate rule's result, and what each answer does."""
    lines = [f"**{model}**: a retrained candidate passed the gate for alias {_code(alias)}.", "",
             f"- Candidate: run {_code(run.run_id)}, checkpoint {_code(metrics.get('checkpoint_tag'))}, "
             f"trained from {run.init.note} on {_code(run.data_url)}"]
    scored = metrics.get("live")
    if live is None:
        lines.append(f"- Live on {_code(alias)}: nothing yet; this would be the first version.")
    else:
        lines.append(f"- Live on {_code(alias)}: **v{live.version}**, published {live.created_at} by "
                     f"{_code(live.created_by)} from {_code(live.data_url)}")
        if scored is not None and scored["version"] != live.version:
            lines.append(f"- Note: evaluate compared against v{scored['version']}; the alias has moved since.")
    live_numbers = scored["metrics"] if scored is not None else {}
    live_head = f"live v{scored['version']}" if scored is not None else "live"
    lines += ["", f"| metric | candidate | {live_head} | change |", "|---|---:|---:|---:|"]
    for name, value in metrics["metrics"].items():
        old = live_numbers.get(name)
        lines.append(f"| {_code(name)} | {_number(value)} | {'' if old is None else _number(old)} | "
                     f"{_change(value, old)} |")
    rules = gate.get("rules") or ()
    verdict = "passed" if gate["publish"] else "refused"
    lines += ["", f"**Gate**: {verdict}" + (":" if rules else f": {gate['reason']}")]
    lines += [f"- {'passed' if r['passed'] else 'FAILED'}: {r['note']}" for r in rules]
    lines += ["", f"**Approve** publishes the candidate as the next version of {_code(model)} and moves "
              f"{_code(alias)} to it. **Reject** publishes nothing (say why in the comment: it becomes the "
              f"run's note). No answer within {format_duration(timeout_s)} rejects it."]
    return "\n".join(lines)


def promotion_body(model: str, alias: str, version: VersionRecord, live: VersionRecord | None,
                   scored: dict[str, Any] | None, gate: dict[str, Any] | None, requested_by: str | None,
                   reason: str, timeout_s: float) -> str:
    """The markdown a person reads before approving a promotion of `version` onto `alias`: where the version came
    from, its numbers next to the live version's (both scored on this alias's suites), every gate rule's result,
    or that the gate was skipped by force."""
    lines = [f"**{model}**: {_code(requested_by or 'a run')} asks to put **v{version.version}** on alias "
             f"{_code(alias)}: {_code(reason or 'promote')}.", "",
             f"- Version: v{version.version}, published {version.created_at} by {_code(version.created_by)}, "
             f"trained from {_code(version.started_from)} on {_code(version.data_url)}",
             f"- Live on {_code(alias)}: " + ("nothing yet" if live is None else
                                              f"**v{live.version}**, published {live.created_at} by "
                                              f"{_code(live.created_by)} from {_code(live.data_url)}")]
    if scored is not None:
        live_numbers = (scored.get("live") or {}).get("metrics") or {}
        lines += ["", f"| metric | v{version.version} | live | change |", "|---|---:|---:|---:|"]
        for name, value in scored["candidate"]["metrics"].items():
            old = live_numbers.get(name)
            lines.append(f"| {_code(name)} | {_number(value)} | {'' if old is None else _number(old)} | "
                         f"{_change(value, old)} |")
    if gate is None:
        lines += ["", "**Gate**: skipped (forced by a mover of this alias)."]
    else:
        lines += ["", f"**Gate**: {'passed' if gate['publish'] else 'refused'}:"]
        lines += [f"- {'passed' if r['passed'] else 'FAILED'}: {r['note']}" for r in gate.get("rules") or ()]
    lines += ["", f"**Approve** moves {_code(alias)} to v{version.version}. **Reject** leaves it where it is. "
              f"No answer within {format_duration(timeout_s)} rejects it."]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_COMMENT]


@dataclass(frozen=True)
class ApprovalAnswer:
    """A person's answer (or the timeout's: `by` None). JSON-shaped, it travels to publish as XCom."""

    approved: bool
    by: str | None
    comment: str = ""

    @classmethod
    def of(cls, approved: bool, responded_by: dict[str, Any] | None, params_input: dict[str, Any] | None
           ) -> ApprovalAnswer:
        """From the human-in-the-loop response: the chosen option, who chose it ({id, name}), the form."""
        who = None
        if responded_by:
            name, uid = str(responded_by.get("name") or ""), str(responded_by.get("id") or "")
            who = _one_line(name if not uid or uid == name else f"{name} (id {uid})" if name else uid)
        comment = _one_line(str((params_input or {}).get("comment") or ""))
        return cls(approved=approved and who is not None, by=who, comment=comment)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ApprovalAnswer:
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def run_note(self, timeout_s: float | None = None) -> str:
        """Why nothing was published, for the run's note."""
        if self.by is None:
            within = "in time" if timeout_s is None else f"within {format_duration(timeout_s)}"
            return (f"approval: nobody answered {within} (publish.approval_timeout_s): timed out, rejected; "
                    "not published")
        because = f": {self.comment}" if self.comment else " (no comment)"
        return f"approval: rejected by {self.by}{because}; not published"

    def attribution(self, automatic_actor: str) -> tuple[str, str]:
        """The (actor, reason) publish records: the approver names the version's creator and the alias move."""
        reason = f"retrain, approved by {self.by}" + (f": {self.comment}" if self.comment else "")
        return via(self.by, automatic_actor), reason


def approver(answer: dict[str, Any] | None) -> str | None:
    """Who approved, from the approval task's XCom (None: no approval was asked, or it was not given)."""
    if answer is None:
        return None
    decided = ApprovalAnswer.from_dict(answer)
    return decided.by if decided.approved else None


def publish_attribution(answer: dict[str, Any] | None, run: str, triggered_by: str | None = None
                        ) -> tuple[str, str]:
    """Who publishes and why: the approver when a person approved, else the person who triggered the run `run`
    (no approval asked), else the run itself (a scheduled or data-triggered run). A rejected candidate is
    never published, even when its publish task is cleared and run again."""
    if answer is None:
        return via(triggered_by, run), "retrain"
    decided = ApprovalAnswer.from_dict(answer)
    if not decided.approved:
        raise RetrainerError(f"{decided.run_note()} (a rejected candidate is never published)")
    return decided.attribution(run)
