CREATE TABLE warren_redeliveries (
    consumer_name     TEXT    NOT NULL,
    message_id        TEXT    NOT NULL,
    deliveries        INTEGER NOT NULL,
    last_delivered_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer_name, message_id)
);
