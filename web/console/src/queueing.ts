// The capacity queue in words (issue 29): why a request waits and why an allocation is preempted, for the
// allocation page and the queue page (the same words the allocations service writes on the timeline).

const REASONS: Record<string, string> = {
  no_capacity: "no ready host has the requested GPUs free",
  over_limit: "the project is at its GPU limit (queue limit or quota)",
  over_tenant_limit: "the tenant is at its GPU limit in this pool",
  waiting_for_preemption: "GPUs borrowed by others are being reclaimed for it",
};

const PREEMPTION_REASONS: Record<string, string> = {
  reclaim_guarantee: "its GPUs are borrowed beyond its queue's guarantee, and a queue below its guarantee is waiting for them",
};

/** Why a queued request waits, in words (an unknown reason as itself). */
export function reasonText(reason: string | null | undefined): string {
  if (!reason) return "waiting";
  return REASONS[reason] ?? reason.replace(/_/g, " ");
}

export function preemptionReasonText(reason: string | null | undefined): string {
  if (!reason) return "capacity is reclaimed";
  return PREEMPTION_REASONS[reason] ?? reason.replace(/_/g, " ");
}

/** A span of seconds as "1 h 5 min", "4 min 12 s", "9 s". */
export function span(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${s} s`;
}
