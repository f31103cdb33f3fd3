CREATE TABLE warren_settings (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
