"""Run the agent's overlay and containment code as one simulated host runs it, inside that host's network
namespace (`ip netns exec <host> python overlay_host.py <request.json>`):

    {"op": "join", "bridge": ..., "lock_dir": ..., "segment": {vni, subnet, local, peers: [[underlay, [address]]]}}
    {"op": "leave", "bridge": ..., "lock_dir": ..., "vni": ...}

`join` is what a provision (or a peer update) does on a container host: the project's bridge gets its VXLAN
port and forwarding entries (overlay.join) and is contained (firewall.Firewall.attach, the GPUAAS chains)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from gpuaas.node_agent import overlay
from gpuaas.node_agent.firewall import EgressPolicy, Firewall


async def main(request: dict[str, Any]) -> None:
    firewall = Firewall(Path(request["lock_dir"]), EgressPolicy.build(None, []))
    key = request["bridge"].replace("-", "")
    if request["op"] == "join":
        s = request["segment"]
        seg = overlay.segment(s["vni"], s["subnet"], s["local"], [(u, a) for u, a in s.get("peers", [])])
        await overlay.join(request["bridge"], seg)
        await firewall.attach(key, request["bridge"])
    elif request["op"] == "leave":
        await overlay.leave(int(request["vni"]))
        await firewall.detach(key)
    print(json.dumps({"segments": await overlay.segments()}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text())))
