CREATE TABLE warren_redeliveries (
    consumer_name     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id        VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    deliveries        BIGINT       NOT NULL,
    last_delivered_at DATETIME(6)  NOT NULL DEFAULT (UTC_TIMESTAMP(6)),
    PRIMARY KEY (consumer_name, message_id),
    INDEX warren_redeliveries_age (consumer_name, last_delivered_at)
) ENGINE = InnoDB;
