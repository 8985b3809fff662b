"""Kafka ACLs per service, derived from the topic registry: who may write and read which topic.

Each service connects as its own SASL user (`gpuaas-<service>` by default, the chart's
`kafka.sasl.users`), and the broker's authorizer allows it exactly this:
- Write (and Describe) on the topics it owns (`Topic.owner`; every service on the audit topic, owner "*");
- Read (and Describe) on the topics it consumes (`Topic.consumers`), and Read on its own consumer group;
- Describe on every topic of the registry (metadata only: the kit checks at start that they exist).
Nothing else: in particular only identity may write `gpuaas.identity.v1`, so a compromised service or a
neighbour on a shared cluster cannot put an access-granting event there (the envelope signature,
gpuaas.kit.event_signing, is the second, end-to-end line). Topics are created beforehand by an admin
(docs/operations.md), so services need no Create.

`python -m gpuaas.kit.kafka_acls [--prefix P] [--user-prefix gpuaas-]` prints the `kafka-acls.sh` commands.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gpuaas.contracts import TOPICS

# Registry names (topic owners and consumers) -> the service's own name (its consumer group).
SERVICES = ("identity", "allocations", "catalog", "app-runtime", "metering", "billing")


@dataclass(frozen=True)
class Grant:
    resource: str  # topic | group
    name: str
    operation: str  # read | write | describe

    def as_tuple(self) -> tuple[str, str, str]:
        return (self.resource, self.name, self.operation)


def group_of(service: str) -> str:
    """The consumer group the kit uses for a service (its spec name: `app_runtime`, not `app-runtime`)."""
    return service.replace("-", "_")


def service_grants(service: str, prefix: str = "") -> list[Grant]:
    """The literal ACLs `service` needs on a cluster where its topics carry `prefix`."""
    grants: list[Grant] = []
    for topic in TOPICS.values():
        name = prefix + topic.name
        grants.append(Grant("topic", name, "describe"))
        if topic.owner in (service, "*"):
            grants.append(Grant("topic", name, "write"))
        if service in topic.consumers:
            grants.append(Grant("topic", name, "read"))
    if any(service in t.consumers for t in TOPICS.values()):
        grants.append(Grant("group", prefix + group_of(service), "read"))
    return sorted(set(grants), key=lambda g: (g.resource, g.name, g.operation))


def writers(topic: str) -> list[str]:
    owner = TOPICS[topic].owner
    return list(SERVICES) if owner == "*" else [owner]


def commands(prefix: str = "", user_prefix: str = "gpuaas-", bootstrap: str = "$BOOTSTRAP") -> list[str]:
    out: list[str] = []
    for service in SERVICES:
        for g in service_grants(service, prefix):
            kind = "--topic" if g.resource == "topic" else "--group"
            out.append(
                f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config admin.properties --add "
                f"--allow-principal User:{user_prefix}{service} --operation {g.operation.capitalize()} "
                f"{kind} {g.name} --resource-pattern-type literal"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prefix", default="", help="kafka.topicPrefix of the deployment")
    parser.add_argument("--user-prefix", default="gpuaas-", help="SASL user of a service: <user-prefix><service>")
    args = parser.parse_args(argv)
    print("\n".join(commands(args.prefix, args.user_prefix)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
