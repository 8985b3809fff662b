"""Settings of the identity service (env prefix `GPUAAS_IDENTITY_`)."""

from pydantic import SecretStr

from gpuaas.kit.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("identity")

    service_name: str = "identity"
    port: int = 8001
    # The issuer URL clients see (through the gateway); tokens carry it as `iss`.
    public_url: str = "http://127.0.0.1:8000/api/identity"
    access_token_ttl_s: int = 900
    # Refresh tokens rotate on every use; a session (refresh-token family) ends at the latest after this.
    refresh_token_ttl_s: int = 14 * 24 * 3600
    session_max_age_s: int = 30 * 24 * 3600
    id_token_ttl_s: int = 300
    authorization_code_ttl_s: int = 60
    sso_state_ttl_s: int = 600
    # The single-use code a completed SSO login hands to `return_to` lives this long.
    sso_login_code_ttl_s: int = 60
    # Origins besides public_url's that may receive an SSO result (a console served elsewhere).
    # The CLI's loopback listener (http://127.0.0.1:<port>/...) is always allowed.
    sso_return_origins: list[str] = []
    # Brute-force protection (service/throttle.py), over a sliding window: per source address (any account;
    # accounts that signed in from that address within known_source_ttl_s are exempt), and per account from
    # one source address (a backoff; the account itself is never locked). Failures of one account from one
    # address that start a backoff.
    lockout_threshold: int = 5
    # The sliding window of failed logins counted (per address, per account from an address).
    lockout_window_s: int = 900
    # The first backoff of an account from one address; each further one within backoff_memory_s doubles it.
    lockout_s: int = 300
    # The longest backoff.
    lockout_max_s: int = 6 * 3600
    # How long backoffs are remembered for doubling (a successful login from the address forgets them).
    backoff_memory_s: int = 24 * 3600
    # Failed logins from one source address (any account) in the window that refuse its further logins.
    source_threshold: int = 50
    # An account that signed in from an address this recently is exempt from that address's throttle.
    known_source_ttl_s: int = 30 * 24 * 3600
    # Proxies whose X-Forwarded-For is believed (the gateway, a load balancer): addresses or CIDR networks.
    # The caller is the right-most hop that is not one of them.
    trusted_proxies: list[str] = ["127.0.0.1", "::1"]
    # Calls to enterprise identity providers (discovery, token exchange, JWKS) go through the outbound
    # guard (gpuaas.kit.outbound): each whole request within this many seconds.
    idp_timeout_s: float = 10.0
    # The largest IdP response body read (discovery document, JWKS, token response); larger is a failure.
    idp_max_response_bytes: int = 1 << 20
    # CIDRs an IdP may be reached on although denied by default (loopback, private, link-local, shared,
    # multicast, reserved and their IPv6 forms): e.g. an IdP inside the company network. Default: none.
    idp_allowed_networks: list[str] = []
    # Hosts (host or host:port) whose issuers may be plain http; every other issuer must be https.
    idp_plain_http_hosts: list[str] = []
    # DNS servers ("ip" or "ip:port") for domain-ownership TXT challenges and for resolving IdP hosts;
    # empty: the system's resolver.
    dns_nameservers: list[str] = []
    # Timeout of one DNS lookup (all servers tried) through `dns_nameservers`.
    dns_timeout_s: float = 3.0
    # Domain proofs do not last for ever: a DNS-proven domain's TXT record is looked up again once its proof
    # is this old; gone, the domain is unverified (service/domain_proofs.py).
    domain_reverify_after_s: int = 24 * 3600
    # How often the re-verification loop looks for due proofs (0: never).
    domain_reverify_every_s: float = 600.0
    # First platform operator, created at first start when no user has this email.
    bootstrap_admin_email: str | None = None
    bootstrap_admin_password: SecretStr | None = None
