CREATE TABLE warren_inbox (
    consumer_name  TEXT        NOT NULL,
    message_id     TEXT        NOT NULL,
    event_type     TEXT        NOT NULL,
    correlation_id TEXT        NULL,
    received_at    TIMESTAMPTZ NOT NULL,
    processed_at   TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer_name, message_id)
);

CREATE INDEX warren_inbox_processed_at ON warren_inbox (consumer_name, processed_at);
