"""App-runtime's HTTP surface, one router per audience (thin: parse, call one use case, shape the answer;
rules and reads live in `service`, one transaction per request):

- `users`: people deploying, inspecting, operating and decommissioning instances (and the timeline SSE);
- `operators`: recovery of member operations (retry, cancel, force-fail);
- `controllers`: an app's controller (a project service account bound to the app): desired state,
  leases on operations, reports and the access credential;
- `controller_state`: a controller's own versioned state per instance (the SDK's `StoredState`);
- `workloads`: the gateway's look-ups for a launchable app's browser workload (`/apps/{instance_id}/`).
"""

from gpuaas.app_runtime.api import controller_state, controllers, operators, users, workloads

# In this order: the OpenAPI lists the routes as they are added.
routers = [users.router, operators.router, controllers.router, controller_state.router, workloads.router]
