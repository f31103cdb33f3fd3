CREATE TABLE warren_outbox (
    id           BIGSERIAL   PRIMARY KEY,
    message_id   TEXT        NOT NULL UNIQUE,
    exchange     TEXT        NOT NULL,
    routing_key  TEXT        NOT NULL,
    properties   TEXT        NOT NULL,
    body         BYTEA       NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    attempts     BIGINT      NOT NULL DEFAULT 0,
    last_error   TEXT        NULL,
    published_at TIMESTAMPTZ NULL,
    failed_at    TIMESTAMPTZ NULL
);

CREATE INDEX warren_outbox_pending ON warren_outbox (id)
    WHERE published_at IS NULL AND failed_at IS NULL;

CREATE INDEX warren_outbox_published ON warren_outbox (published_at)
    WHERE published_at IS NOT NULL;
