"""Django settings, read once from the environment; every default runs a fresh checkout.

Embedded default: SQLite in var/, in-memory channel layer, Celery tasks run
in-process. Set DATABASE_URL (PostgreSQL) and REDIS_URL (channel layer and
Celery broker) for production; production-only rules are system checks.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from crowdtrain_agent.protocol.frames import OLDEST_MINOR, PROTOCOL_MINOR

from .campaigns.isolation import isolate_tab_static
from .env import env_bool, env_choice, env_email_url, env_float, env_hex_bytes, env_int, env_list, env_str
from .periodic import beat_schedule

BASE_DIR = Path(__file__).resolve().parents[2]
VAR_DIR = Path(env_str("CROWDTRAIN_VAR_DIR", str(BASE_DIR / "var")))

# Off unless asked for (CROWDTRAIN_DEBUG=true): with it on, every 404 lists the URL map and every 500
# renders a traceback page that took 5-17 s of a site process's time, long enough to halve training.
DEBUG = env_bool("CROWDTRAIN_DEBUG", False)
SECRET_KEY = env_str("CROWDTRAIN_SECRET_KEY", "insecure-dev-key-change-me-in-production-0123456789")
if not SECRET_KEY.strip():  # an env file's `CROWDTRAIN_SECRET_KEY=` left unfilled (deploy/production.env.example)
    raise ImproperlyConfigured(
        "CROWDTRAIN_SECRET_KEY is empty; set it to a long random string "
        "(python -c 'import secrets; print(secrets.token_urlsafe(50))')"
    )
ALLOWED_HOSTS = env_list("CROWDTRAIN_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CROWDTRAIN_CSRF_TRUSTED_ORIGINS", [])
# Set below, once the HTTPS settings are read: cookies follow the scheme browsers use, not DEBUG, so
# a plain-HTTP site on loopback (make serve, the demo) keeps its log-ins with DEBUG off.
# Explicit although they are Django's defaults: the session cookie is never readable
# from JavaScript and is not sent on cross-site POSTs.
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = CSRF_COOKIE_SAMESITE = "Lax"
# Off by default: a site reached over plain HTTP would lock itself out of browsers.
SECURE_HSTS_SECONDS = env_int("CROWDTRAIN_HSTS_SECONDS", 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("CROWDTRAIN_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = env_bool("CROWDTRAIN_HSTS_PRELOAD", False)
# Behind a balancer that terminates TLS (deploy/) daphne only ever sees plain HTTP: the balancer says
# which scheme the browser used in X-Forwarded-Proto, overwriting whatever a client sent. Trust the
# header only then, or any client could claim https.
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("CROWDTRAIN_TRUST_FORWARDED_PROTO", False) else None
)
SECURE_SSL_REDIRECT = env_bool("CROWDTRAIN_SECURE_SSL_REDIRECT", False)
# The balancer's health checks speak plain HTTP to each site process; a redirect would read as "down".
# /metrics too: Prometheus scrapes each site process directly, inside the deployment's network.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^livez$", r"^metrics$"]
# Browsers reach the site over HTTPS when it redirects them there or a trusted proxy ends TLS for it
# (deploy/ and make cluster do both). Cookies then travel over HTTPS only, and e-mailed links say https.
SERVED_OVER_HTTPS = SECURE_SSL_REDIRECT or SECURE_PROXY_SSL_HEADER is not None
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SERVED_OVER_HTTPS
# For a check an operator has decided against (e.g. security.W021 when the domain is not to be preloaded).
SILENCED_SYSTEM_CHECKS = env_list("CROWDTRAIN_SILENCED_CHECKS", [])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "allauth",
    "allauth.account",
    "crowdtrain.accounts",
    "crowdtrain.datasets",
    "crowdtrain.browser",
    "crowdtrain.campaigns",
    "crowdtrain.scheduler",
    "crowdtrain.devices",
    "crowdtrain.credit",
    "crowdtrain.verification",
    "crowdtrain.gateway",
    "crowdtrain.ops",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "allauth.account.middleware.AccountMiddleware",
]
# Each site process serves static files itself, whatever DEBUG says (see STATIC_ROOT below).
MIDDLEWARE.insert(1, "whitenoise.middleware.WhiteNoiseMiddleware")

ROOT_URLCONF = "crowdtrain.urls"
ASGI_APPLICATION = "crowdtrain.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "crowdtrain.campaigns.navigation.navigation",
                "crowdtrain.campaigns.navigation.contact",
            ],
        },
    },
]

# SQLite waits for the write lock instead of failing at once, and opens its
# transactions IMMEDIATE so two writers never deadlock upgrading read locks.
# WAL with synchronous=NORMAL syncs at checkpoints, not at every commit: the
# lease path commits several times per step, and a power cut can lose only
# the last few commits, never corrupt the file.
_SQLITE_OPTIONS = {
    "timeout": 30,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
# Persistent connections: Channels runs every database call of a consumer in
# one worker thread, and opening a connection per message costs more than the
# scheduler's queries themselves. Health checks replace connections that died.
DATABASES = {
    "default": dj_database_url.parse(
        env_str("DATABASE_URL", f"sqlite:///{VAR_DIR / 'crowdtrain.sqlite3'}"),
        conn_max_age=env_int("CROWDTRAIN_DB_CONN_MAX_AGE", 600, minimum=0),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES["default"]["OPTIONS"] = _SQLITE_OPTIONS
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test.sqlite3")}
# Threads a served site process runs the scheduler's blocking calls in (``gateway.offloop``: Redis
# scripts, batched database writes). Each call mostly waits on a round trip, so more threads than
# cores pay, up to a point: 16 served more lease cycles than asyncio's default and 32 no more than 16
# (docs/performance.md, "Scheduler threads"). Each thread keeps its own
# database connection: allow this many, plus a few, per site process in PostgreSQL's max_connections.
# SQLite takes one writer at a time, so the embedded default keeps asyncio's own pool size there (0).
CROWDTRAIN_SCHEDULER_THREADS = env_int(
    "CROWDTRAIN_SCHEDULER_THREADS", 0 if DATABASES["default"]["ENGINE"].endswith("sqlite3") else 16, minimum=0
)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = env_str("REDIS_URL", "")
# A consumer waits for its next event in a blocking pop of up to 5 s (channels_redis's brpop_timeout);
# redis-py 8 aborts any read after socket_timeout, 5 s by default, and the consumer then crashes and its
# socket drops: aggregators and agents were cut off after every 5 idle seconds. Reads must outlast the pop.
CHANNEL_LAYER_READ_TIMEOUT_S = 30.0
# redis-py's asyncio pool holds 100 connections and then raises "Too many connections": with thousands
# of sockets joining groups at once, consumers crashed and their volunteers were cut off. Past this
# many, a call now waits for a free connection (``gateway.channel_layer``).
CHANNEL_LAYER_MAX_CONNECTIONS = env_int("CROWDTRAIN_CHANNEL_LAYER_MAX_CONNECTIONS", 1000, minimum=10)
# channels_redis keeps every socket of one site process in a single Redis list (the part of a channel
# name before "!"), so its capacity bounds the events queued for the whole process, not for one socket.
# At its default of 100, a busy process's inbox filled in the scale bench's overload phase: sends to it
# raised ChannelFull by the thousand, and a group send (a new version, a commit for the aggregators)
# skips a full inbox. Events are a few hundred bytes; channels_redis drops any older than a minute.
CHANNEL_LAYER_CAPACITY = env_int("CROWDTRAIN_CHANNEL_LAYER_CAPACITY", 20_000, minimum=100)
# The cache holds allauth's rate-limit counters: with several site processes they
# must share one Redis, or each process would count failed logins on its own.
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "crowdtrain.gateway.channel_layer.WaitingRedisChannelLayer",
            "CONFIG": {
                "hosts": [
                    {
                        "address": REDIS_URL,
                        "socket_timeout": CHANNEL_LAYER_READ_TIMEOUT_S,
                        "max_connections": CHANNEL_LAYER_MAX_CONNECTIONS,
                    }
                ],
                # For the process inbox only ("specific.<process>!"); "capacity" stays channels_redis's
                # 100, which also bounds each socket's buffer in the process, a dead socket's included.
                "channel_capacity": {"specific.*": CHANNEL_LAYER_CAPACITY},
            },
        }
    }
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "crowdtrain",
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# Celery: with no broker configured, tasks run in-process (embedded default).
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL or "memory://")
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", not REDIS_URL)
CELERY_TASK_EAGER_PROPAGATES = True
# With eager Celery (no worker), long tasks a page shows progress of (sharding an upload) run in a
# background thread instead of inside the request; the test process turns this off to run them inline.
CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND = env_bool("CROWDTRAIN_EAGER_TASKS_IN_BACKGROUND", True)
# Browser compute (issue 36): when a campaign starts, export its model's gradient graph for browser tabs and
# gate it against PyTorch (seconds to minutes of CPU in a worker). Off: no tab is offered any campaign.
CROWDTRAIN_BROWSER_GRAPHS = env_bool("CROWDTRAIN_BROWSER_GRAPHS", True)
# A check that has not finished in this long (its worker died) may be taken again by the next one asked for.
CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S = env_float("CROWDTRAIN_BROWSER_GRAPH_TIMEOUT_S", 900.0, minimum=60.0)
# A third graph of this many microbatches a run, for models whose samples do not meet in a batch (no batch
# norm): a tab copies the parameters in and every gradient out once a run, so fewer, wider runs cost less.
# 1: none.
CROWDTRAIN_BROWSER_WIDE_MICROBATCHES = env_int("CROWDTRAIN_BROWSER_WIDE_MICROBATCHES", 4, minimum=1)
# Celery's Django fixup closes the worker's database connections around every task unless told to
# reuse them this many times; ``crowdtrain.celery`` checks them now and then instead, as the site does.
CELERY_DB_REUSE_MAX = 1_000_000
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Every periodic job of the site, with its period, is listed in crowdtrain/periodic.py.
CELERY_BEAT_SCHEDULE = beat_schedule()

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATICFILES_DIRS = [BASE_DIR / "frontend" / "static"]
# Collected (manage.py collectstatic: deploy/'s image, make cluster), static files are read once from
# STATIC_ROOT at start-up. A checkout that never collected them serves each from its source folder,
# looked up per request, so `make serve` and the demo need no collectstatic and show edits at once.
WHITENOISE_USE_FINDERS = WHITENOISE_AUTOREFRESH = not STATIC_ROOT.is_dir()
# The browser tab's worker and onnxruntime-web files are served cross-origin isolated, as its page is.
WHITENOISE_ADD_HEADERS_FUNCTION = isolate_tab_static
MEDIA_ROOT = Path(env_str("CROWDTRAIN_MEDIA_ROOT", str(VAR_DIR / "media")))
MEDIA_URL = "media/"
# Shards, uploads, checkpoints and exports: the media folder, or any S3-compatible store
# when CROWDTRAIN_S3_BUCKET is set. All code goes through default_storage, never a path.
CROWDTRAIN_S3_BUCKET = env_str("CROWDTRAIN_S3_BUCKET", "")
if CROWDTRAIN_S3_BUCKET:
    _DEFAULT_STORAGE: dict = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": CROWDTRAIN_S3_BUCKET,
            # Unset values fall back to boto3's own chain (AWS_* variables, instance roles).
            "endpoint_url": env_str("CROWDTRAIN_S3_ENDPOINT_URL", "") or None,
            "access_key": env_str("CROWDTRAIN_S3_ACCESS_KEY_ID", "") or None,
            "secret_key": env_str("CROWDTRAIN_S3_SECRET_ACCESS_KEY", "") or None,
            "region_name": env_str("CROWDTRAIN_S3_REGION", "") or None,
            # Shards are served through the site (ETag, Range, visibility), never by public URL.
            "default_acl": None,
            "querystring_auth": True,
            "file_overwrite": True,
        },
    }
else:
    _DEFAULT_STORAGE = {"BACKEND": "django.core.files.storage.FileSystemStorage"}
STORAGES = {
    "default": _DEFAULT_STORAGE,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# ----------------------------------------------------------- dataset uploads

CROWDTRAIN_MAX_UPLOAD_BYTES = env_int("CROWDTRAIN_MAX_UPLOAD_BYTES", 8 << 30, minimum=1)
# One PUT of a chunked upload; the body is read into memory, so keep it small.
CROWDTRAIN_UPLOAD_CHUNK_BYTES = env_int("CROWDTRAIN_UPLOAD_CHUNK_BYTES", 8 << 20, minimum=1024)
# The held-out validation split: this fraction of the samples (at least one), from the end.
CROWDTRAIN_VALIDATION_FRACTION = env_float("CROWDTRAIN_VALIDATION_FRACTION", 0.05, minimum=0.0)
if CROWDTRAIN_VALIDATION_FRACTION >= 0.5:
    raise ImproperlyConfigured(
        f"CROWDTRAIN_VALIDATION_FRACTION must be below 0.5, got {CROWDTRAIN_VALIDATION_FRACTION}; 0.05 holds out 5%"
    )
CROWDTRAIN_SHARD_BYTES = env_int("CROWDTRAIN_SHARD_BYTES", 4 << 20, minimum=1024)
# A BPE tokenizer trained on an upload has this many tokens unless the upload asks for another size.
CROWDTRAIN_TOKENIZER_VOCAB = env_int("CROWDTRAIN_TOKENIZER_VOCAB", 8192, minimum=256)
# The largest tokenizer.json an organizer may upload (Llama 3's is 9 MB).
CROWDTRAIN_MAX_TOKENIZER_BYTES = env_int("CROWDTRAIN_MAX_TOKENIZER_BYTES", 64 << 20, minimum=1024)
# Uploaded images are resized to squares of this many pixels a side unless the upload asks for another size.
CROWDTRAIN_IMAGE_SIZE = env_int("CROWDTRAIN_IMAGE_SIZE", 32, minimum=8)
# An image file that decodes to more pixels than this is refused (a small file can hold a huge image).
CROWDTRAIN_MAX_IMAGE_PIXELS = env_int("CROWDTRAIN_MAX_IMAGE_PIXELS", 64_000_000, minimum=1024)
# Uploads still unfinished this long after they started are deleted, bytes and all.
CROWDTRAIN_UPLOAD_EXPIRY_S = env_int("CROWDTRAIN_UPLOAD_EXPIRY_S", 7 * 86400, minimum=60)
# The validation loss of a campaign averages over at most this many held-out samples.
CROWDTRAIN_VALIDATION_SAMPLES = env_int("CROWDTRAIN_VALIDATION_SAMPLES", 1024, minimum=1)
# Each validated version's weights are kept for export; older ones are deleted past this many per campaign.
CROWDTRAIN_EXPORTS_KEPT = env_int("CROWDTRAIN_EXPORTS_KEPT", 10, minimum=1)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# text: one readable line per record; json: one JSON object per line (crowdtrain_agent.logformat), with the
# campaign, lease, device and step ids the training path passes as extra= fields, for a log pipeline.
CROWDTRAIN_LOG_FORMAT = env_choice("CROWDTRAIN_LOG_FORMAT", "text", ("text", "json"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        "json": {"()": "crowdtrain_agent.logformat.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "json" if CROWDTRAIN_LOG_FORMAT == "json" else "plain",
        },
        # The admin dashboard's "errors from the last hour": ERROR records into a capped Redis list.
        "recent_errors": {"class": "crowdtrain.ops.recent_errors.RecentErrorsHandler", "level": "ERROR"},
    },
    "loggers": {
        "crowdtrain": {
            "handlers": ["console", "recent_errors"],
            "level": env_str("CROWDTRAIN_LOG_LEVEL", "INFO"),
            "propagate": False,
        },
        # Django prints a 500's traceback only when DEBUG is on (otherwise it mails it to ADMINS, whom we
        # have none of): with DEBUG off, this is what puts it in the site's log.
        "django": {"handlers": ["console", "recent_errors"], "level": "ERROR", "propagate": False},
    },
}

# ----------------------------------------------------------- operations (crowdtrain.ops)

# Set, /metrics answers only requests with `Authorization: Bearer <token>` (Prometheus reads it from a
# file). Unset, it answers only loopback and private addresses that no proxy relayed (no X-Forwarded-For).
CROWDTRAIN_METRICS_TOKEN = env_str("CROWDTRAIN_METRICS_TOKEN", "")
# A running campaign with every aggregator ready that has committed no step for this long is stalled.
CROWDTRAIN_STALLED_AFTER_MIN = env_float("CROWDTRAIN_STALLED_AFTER_MIN", 10.0, minimum=0.1)
# Expired and rejected leases above this share of a campaign's lease outcomes in 10 minutes raise an alert.
CROWDTRAIN_LEASE_FAILURE_SHARE = env_float("CROWDTRAIN_LEASE_FAILURE_SHARE", 0.5, minimum=0.0)
# The admin dashboard (/dashboard/) pushes a fresh snapshot this often to each open page.
CROWDTRAIN_DASHBOARD_PUSH_S = env_float("CROWDTRAIN_DASHBOARD_PUSH_S", 2.0, minimum=0.2)

# ----------------------------------------------------------- the scheduler

# A lease should take about this long on the device it goes to.
CROWDTRAIN_LEASE_TARGET_S = env_float("CROWDTRAIN_LEASE_TARGET_S", 15.0, minimum=0.1)
# Never give a lease less time than this, whatever the device's speed.
CROWDTRAIN_LEASE_MIN_DEADLINE_S = env_float("CROWDTRAIN_LEASE_MIN_DEADLINE_S", 30.0, minimum=1.0)
# However slow a device says it is, its lease is freed after this long: a stranger reporting a
# tiny speed must not hold a step's samples (and so the step) for ever.
CROWDTRAIN_LEASE_MAX_DEADLINE_S = env_float("CROWDTRAIN_LEASE_MAX_DEADLINE_S", 600.0, minimum=1.0)
CROWDTRAIN_MAX_LEASE_SAMPLES = env_int("CROWDTRAIN_MAX_LEASE_SAMPLES", 65536, minimum=1)
# The largest model a campaign may train, in parameters (counted from its config before anything is built).
CROWDTRAIN_MAX_MODEL_PARAMS = env_int("CROWDTRAIN_MAX_MODEL_PARAMS", 2_000_000_000, minimum=1)
# How often idle agents ask again when no lease can be given.
CROWDTRAIN_RETRY_AFTER_S = env_float("CROWDTRAIN_RETRY_AFTER_S", 2.0, minimum=0.05)
# The longest the site holds a lease request while every step the device may work on is full
# (the agent asks with wait_s): answered the moment a commit makes room. 0 answers at once.
CROWDTRAIN_LEASE_WAIT_MAX_S = env_float("CROWDTRAIN_LEASE_WAIT_MAX_S", 10.0, minimum=0.0)
# Steps of at least this many leases go to a committer when one runs (scheduler.committer); smaller ones
# are written by the site process whose report filled them, which then answers its waiting request at once.
CROWDTRAIN_COMMITTER_MIN_LEASES = env_int("CROWDTRAIN_COMMITTER_MIN_LEASES", 256, minimum=1)
# The most a crash may cost, in checkpoint intervals: a campaign whose newest complete checkpoint falls
# this many times checkpoint_every behind its committed steps commits and leases no more until checkpoints
# catch up (scheduler.durability). 0 lets the lag grow without bound.
CROWDTRAIN_CHECKPOINT_LAG_MAX = env_int("CROWDTRAIN_CHECKPOINT_LAG_MAX", 3, minimum=0)
# Agents and aggregators silent this long are gone; what they held is freed.
CROWDTRAIN_GONE_AFTER_S = env_float("CROWDTRAIN_GONE_AFTER_S", 10.0, minimum=1.0)
CROWDTRAIN_HEARTBEAT_S = env_float("CROWDTRAIN_HEARTBEAT_S", 2.0, minimum=0.1)
# The newest protocol minor this site speaks (agent/PROTOCOL.md, "Versions"): during a rolling upgrade
# of several site processes, keep the new ones at the old minor until every process is upgraded.
CROWDTRAIN_PROTOCOL_MINOR = env_int("CROWDTRAIN_PROTOCOL_MINOR", PROTOCOL_MINOR, minimum=OLDEST_MINOR)
if CROWDTRAIN_PROTOCOL_MINOR > PROTOCOL_MINOR:
    raise ImproperlyConfigured(
        f"CROWDTRAIN_PROTOCOL_MINOR is {CROWDTRAIN_PROTOCOL_MINOR}, but this site knows minors up to "
        f"{PROTOCOL_MINOR}; upgrade the site or lower the setting"
    )
# Agents' heartbeats only keep idle sockets open through NATs and proxies: the site reads an agent's
# liveness from its open socket (daphne's pings drop dead ones), so thousands of idle volunteers
# need not cost a message every two seconds each. Aggregators keep CROWDTRAIN_HEARTBEAT_S: theirs
# drive the site's resends of lost commits. Keep it under daphne's ping interval (30 s,
# crowdtrain.lib.daphne_site), or the site pings every idle agent as well.
CROWDTRAIN_AGENT_HEARTBEAT_S = env_float("CROWDTRAIN_AGENT_HEARTBEAT_S", 25.0, minimum=0.1)
# A lease of the open step still out this many times longer than its device has taken for as many
# samples (a new device: the swarm's typical lease), and at least this many seconds, gets a backup:
# its samples go to another device too, one expected to finish sooner than the original has already
# taken, and the first valid report wins. With no lease finished yet, only the hard deadline does.
CROWDTRAIN_BACKUP_MIN_S = env_float("CROWDTRAIN_BACKUP_MIN_S", 2.0, minimum=0.1)
CROWDTRAIN_BACKUP_FACTOR = env_float("CROWDTRAIN_BACKUP_FACTOR", 2.0, minimum=1.0)
# Verification: how long a copy waits for a volunteer of another account before the check is given up
# (aggregators keep a version's parameters for a few steps only, so a late copy could not train on it).
CROWDTRAIN_CHECK_WAIT_S = env_float("CROWDTRAIN_CHECK_WAIT_S", 120.0, minimum=1.0)
# ...and a volunteer like the original's (same team, machine, network or sign-up time) may take it after this
# long; the referee then decides the check, as their agreement proves nothing.
CROWDTRAIN_CHECK_SIMILAR_WAIT_S = env_float("CROWDTRAIN_CHECK_SIMILAR_WAIT_S", 30.0, minimum=0.0)
# When a campaign issued no lease for this long while its open step holds leases of two or more volunteers on
# probation (each capped at a few leases of a step), their cap in that step grows by itself, up to 4x: a
# campaign with fewer volunteers than leases per step does not stall (one account alone never fills a step).
CROWDTRAIN_PROBATION_RELIEF_S = env_float("CROWDTRAIN_PROBATION_RELIEF_S", 10.0, minimum=0.0)
# The referee (verification/referee.py): versions kept per campaign for open checks (0: no referee; disputes
# then judge nobody and withhold the original's credit), rulings per campaign and per volunteer per hour, and
# how long a dispute over those bounds waits before it ends unruled.
CROWDTRAIN_REFEREE_VERSIONS_KEPT = env_int("CROWDTRAIN_REFEREE_VERSIONS_KEPT", 32, minimum=0)
CROWDTRAIN_REFEREE_RULINGS_PER_HOUR = env_int("CROWDTRAIN_REFEREE_RULINGS_PER_HOUR", 600, minimum=1)
CROWDTRAIN_REFEREE_VOLUNTEER_RULINGS_PER_HOUR = env_int("CROWDTRAIN_REFEREE_VOLUNTEER_RULINGS_PER_HOUR", 60, minimum=1)
CROWDTRAIN_REFEREE_WAIT_S = env_float("CROWDTRAIN_REFEREE_WAIT_S", 3600.0, minimum=1.0)
# An agent whose socket closed gets this long to reconnect before its leases go to others.
CROWDTRAIN_DISCONNECT_GRACE_S = env_float("CROWDTRAIN_DISCONNECT_GRACE_S", 5.0, minimum=0.0)
# The scheduler's hot state (scheduler/hotstate.py): Redis shared by every site process, or, unset
# with no REDIS_URL either, the same scripts run in this one process.
CROWDTRAIN_SCHEDULER_REDIS_URL = env_str("CROWDTRAIN_SCHEDULER_REDIS_URL", REDIS_URL)
# Every key the site puts in Redis starts with this, so several sites can share one Redis.
CROWDTRAIN_REDIS_PREFIX = env_str("CROWDTRAIN_REDIS_PREFIX", "ct")
# Admission control, per site process (gateway/admission.py): past these, new sockets are closed with 4013
# before any lookup and new lease requests are refused with a growing retry_after_s; done reports,
# which carry work already uploaded, are never turned away.
CROWDTRAIN_MAX_SOCKETS = env_int("CROWDTRAIN_MAX_SOCKETS", 20000, minimum=1)
CROWDTRAIN_MAX_HANDSHAKES = env_int("CROWDTRAIN_MAX_HANDSHAKES", 256, minimum=1)
CROWDTRAIN_MAX_LEASE_CALLS = env_int("CROWDTRAIN_MAX_LEASE_CALLS", 64, minimum=1)
# Write the lease record, and add a commit's credit to the leaderboards, in the caller's thread instead of
# from a background thread (tests).
CROWDTRAIN_RECORDS_INLINE = env_bool("CROWDTRAIN_RECORDS_INLINE", False)
# A socket on /ws/agent/ or /ws/backbone/ that has not said hello this long after it was accepted
# is closed (4000): idle sockets that never speak must not pile up. Agents and aggregators say
# hello at once; the time allows for a slow link, not for thinking.
CROWDTRAIN_HELLO_TIMEOUT_S = env_float("CROWDTRAIN_HELLO_TIMEOUT_S", 5.0, minimum=0.1)
# Every site WebSocket is pinged this often and dropped when its pong is this late (crowdtrain.lib.daphne_site).
CROWDTRAIN_WS_PING_INTERVAL_S = env_float("CROWDTRAIN_WS_PING_INTERVAL_S", 30.0, minimum=1.0)
CROWDTRAIN_WS_PING_TIMEOUT_S = env_float("CROWDTRAIN_WS_PING_TIMEOUT_S", 10.0, minimum=1.0)

# Tickets and receipts are HMAC-signed with a key the site shares only with
# its aggregators (sent to each one after it authenticates).
CROWDTRAIN_TICKET_KEY = env_hex_bytes(
    "CROWDTRAIN_TICKET_KEY", hmac.new(SECRET_KEY.encode(), b"crowdtrain-ticket-key", hashlib.sha256).digest()
)

# ------------------------------------------------ volunteers: accounts and e-mail

AUTHENTICATION_BACKENDS = [
    "django.contrib.auth.backends.ModelBackend",  # staff log in to the admin by username
    "allauth.account.auth_backends.AuthenticationBackend",  # volunteers log in by e-mail
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "account_login"
LOGIN_REDIRECT_URL = "/"

ACCOUNT_LOGIN_METHODS = {"email"}
# No username to invent: allauth derives one from the address, and public pages
# show Profile.public_name instead.
ACCOUNT_SIGNUP_FIELDS = ["email*", "password1*", "password2*"]
ACCOUNT_UNIQUE_EMAIL = True
ACCOUNT_EMAIL_VERIFICATION = "mandatory"
# Confirming the address in the browser that signed up logs the volunteer in and returns them where they started
# (the ``next`` of the sign-up: a campaign's join page, say), instead of to a login form and then the home page.
ACCOUNT_LOGIN_ON_EMAIL_CONFIRMATION = True
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[Crowdtrain] "
# Links in e-mails: a production site sits behind TLS.
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https" if SERVED_OVER_HTTPS else "http"
# Merged into allauth's defaults; the counters live in CACHES.
_LOGIN_FAILURES = env_int("CROWDTRAIN_LOGIN_FAILURES_LIMIT", 5, minimum=1)
_LOGIN_FAILURES_WINDOW_S = env_int("CROWDTRAIN_LOGIN_FAILURES_WINDOW_S", 300, minimum=1)
ACCOUNT_RATE_LIMITS = {
    # Per address: guessing one volunteer's password; per IP: trying many addresses.
    "login_failed": f"10/m/ip,{_LOGIN_FAILURES}/{_LOGIN_FAILURES_WINDOW_S}s/key",
    "signup": f"{env_int('CROWDTRAIN_SIGNUPS_PER_HOUR_PER_IP', 20, minimum=1)}/h/ip",
}
# Behind a reverse proxy every request comes from the proxy's address: say how
# many proxies to trust, or the per-IP limits above count all volunteers as one.
ALLAUTH_TRUSTED_PROXY_COUNT = env_int("CROWDTRAIN_TRUSTED_PROXY_COUNT", 0, minimum=0)

# E-mail: the console unless CROWDTRAIN_EMAIL_URL, or EMAIL_HOST and friends, name an SMTP server.
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "Crowdtrain <noreply@localhost>")
# Where the pages tell people to write for help (a lost verification e-mail, a password reset that fails);
# unset, they say what to do instead and promise no contact.
CROWDTRAIN_CONTACT_EMAIL = env_str("CROWDTRAIN_CONTACT_EMAIL", "")
SERVER_EMAIL = DEFAULT_FROM_EMAIL
_EMAIL = env_email_url("CROWDTRAIN_EMAIL_URL")
if _EMAIL is not None:
    EMAIL_BACKEND = _EMAIL["EMAIL_BACKEND"]
    EMAIL_HOST = _EMAIL["EMAIL_HOST"] or "localhost"
    EMAIL_PORT = _EMAIL["EMAIL_PORT"] or 25
    EMAIL_HOST_USER = _EMAIL["EMAIL_HOST_USER"] or ""
    EMAIL_HOST_PASSWORD = _EMAIL["EMAIL_HOST_PASSWORD"] or ""
    EMAIL_USE_TLS = _EMAIL["EMAIL_USE_TLS"]
    EMAIL_USE_SSL = _EMAIL["EMAIL_USE_SSL"]
    EMAIL_TIMEOUT = _EMAIL["EMAIL_TIMEOUT"]
    EMAIL_FILE_PATH = _EMAIL["EMAIL_FILE_PATH"] or str(VAR_DIR / "mail")
elif env_str("EMAIL_HOST", ""):
    EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    EMAIL_HOST = env_str("EMAIL_HOST", "")
    EMAIL_PORT = env_int("EMAIL_PORT", 587, minimum=1)
    EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
    EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
    EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", True)
    EMAIL_TIMEOUT = 30
else:
    EMAIL_BACKEND = "django.core.mail.backends.console.EmailBackend"

# ------------------------------------------------ agents: device-code login (RFC 8628)

# How long a code shown by `crowdtrain-agent login` stays usable, and how often the agent may poll.
CROWDTRAIN_DEVICE_CODE_TTL_S = env_int("CROWDTRAIN_DEVICE_CODE_TTL_S", 600, minimum=30)
CROWDTRAIN_DEVICE_CODE_INTERVAL_S = env_int("CROWDTRAIN_DEVICE_CODE_INTERVAL_S", 5, minimum=1)
# Codes one client IP may ask for, and wrong user codes one account may type, per 10 minutes.
CROWDTRAIN_DEVICE_CODES_PER_IP = env_int("CROWDTRAIN_DEVICE_CODES_PER_IP", 30, minimum=1)
CROWDTRAIN_USER_CODE_FAILURES = env_int("CROWDTRAIN_USER_CODE_FAILURES", 20, minimum=1)
# Devices one volunteer may make for browser tabs (POST /devices/tab/) per 10 minutes; each also counts
# against CROWDTRAIN_DEVICE_CODES_PER_IP, as an agent's login does.
CROWDTRAIN_TAB_DEVICES_PER_USER = env_int("CROWDTRAIN_TAB_DEVICES_PER_USER", 10, minimum=1)
# What the join page tells volunteers to `pip install`. Empty (the default): the agent wheel this site
# serves at /agent/crowdtrain_agent-<version>-py3-none-any.whl, the one it is compatible with. Otherwise a
# PyPI name or any URL pip accepts, for a site whose agents come from elsewhere.
CROWDTRAIN_AGENT_PIP_SPEC = env_str("CROWDTRAIN_AGENT_PIP_SPEC", "")
# Where `manage.py build_agent_wheel` writes that wheel and the site reads it from (never committed).
CROWDTRAIN_AGENT_WHEEL_DIR = Path(env_str("CROWDTRAIN_AGENT_WHEEL_DIR", str(VAR_DIR / "agent")))
