CREATE TABLE warren_outbox (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id   VARBINARY(255) NOT NULL,
    exchange     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    routing_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    properties   MEDIUMTEXT   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    body         LONGBLOB     NOT NULL,
    created_at   DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    attempts     BIGINT       NOT NULL DEFAULT 0,
    last_error   TEXT         CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL,
    published_at DATETIME(6)  NULL,
    failed_at    DATETIME(6)  NULL,
    UNIQUE KEY warren_outbox_message_id (message_id),
    INDEX warren_outbox_state (published_at, failed_at, id),
    INDEX warren_outbox_failed (failed_at, id)
) ENGINE = InnoDB;
