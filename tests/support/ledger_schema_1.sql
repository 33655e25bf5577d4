-- the ledger schema 1 as broker wrote it before stop / start and attempt rows, frozen (tests/support/ledgers.py;
-- tests/money/test_stop_start.py and tests/run/test_preempt.py migrate it)

CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    recipe_path TEXT,
    recipe TEXT,
    plan TEXT,
    provider TEXT,
    topology TEXT,
    status TEXT NOT NULL,
    created_at TEXT NOT NULL,
    started_at TEXT,
    ended_at TEXT,
    deadline TEXT,
    budget_usd REAL,
    exit_codes TEXT,
    run_dir TEXT,
    log_paths TEXT,
    message TEXT,
    pid INTEGER
);
CREATE TABLE IF NOT EXISTS resources (
    id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    provider TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    provider_id TEXT,
    region TEXT,
    zone TEXT,
    state TEXT NOT NULL,
    usd_per_hour REAL NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    running_since TEXT,
    terminated_at TEXT,
    deadline TEXT,
    terminated_by TEXT,
    error TEXT,
    attrs TEXT
);
CREATE INDEX IF NOT EXISTS resources_run ON resources(run_id);
CREATE INDEX IF NOT EXISTS resources_state ON resources(state);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at TEXT NOT NULL,
    run_id TEXT,
    resource_id TEXT,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    message TEXT
);
CREATE INDEX IF NOT EXISTS events_run ON events(run_id);
CREATE TABLE IF NOT EXISTS quota_requests (
    id TEXT PRIMARY KEY,
    provider TEXT NOT NULL,
    region TEXT,
    scope TEXT,
    limit_name TEXT NOT NULL,
    requested_value REAL NOT NULL,
    unit TEXT,
    provider_request_id TEXT,
    state TEXT,
    reason TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT,
    detail TEXT
);
