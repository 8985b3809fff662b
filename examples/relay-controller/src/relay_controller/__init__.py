"""The second example of docs/app-controllers.md: `gpuaas-controller run relay_controller:RelayController`."""

from relay_controller.controller import MANIFEST, RelayController

__all__ = ["MANIFEST", "RelayController"]
