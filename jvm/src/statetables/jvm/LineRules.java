package statetables.jvm;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.math.BigDecimal;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;

/**
 * A stream's line rules, read from the JSON that pipelines/validate.py writes from a StreamSpec: the id field, each
 * field's kind and rule, and every detail text a reason carries. The rules are data, so one validator serves every
 * stream; the texts are made in Python, so they have one home.
 */
final class LineRules {
    enum Kind { STRING, DECIMAL, TIMESTAMP, INTEGER, BOOLEAN }

    static final class Field {
        final String name;
        final Kind kind;
        final boolean required;
        final boolean trim;
        final int maxLength;  // 0: no limit
        final BigDecimal min;  // decimals and integers: lower bound, or null
        final boolean minInclusive;
        final BigDecimal max;  // decimals and integers: upper bound, or null (then only the stored type's own)
        final boolean maxInclusive;
        final int slot;  // index into the result's array of this kind
        final int position;  // index among the stream's fields
        final Map<String, String> details = new HashMap<>();  // reason -> detail (a wrong_type's is a prefix)

        Field(JsonNode node, int slot, int position) {
            name = node.get("name").asText();
            kind = Kind.valueOf(node.get("kind").asText().toUpperCase());
            required = node.get("required").asBoolean();
            trim = node.path("trim").asBoolean(false);
            maxLength = node.path("max_length").asInt(0);
            min = node.hasNonNull("min") ? new BigDecimal(node.get("min").asText()) : null;
            minInclusive = node.path("min_inclusive").asBoolean(true);
            max = node.hasNonNull("max") ? new BigDecimal(node.get("max").asText()) : null;
            maxInclusive = node.path("max_inclusive").asBoolean(true);
            this.slot = slot;
            this.position = position;
            node.get("details").properties().forEach(e -> details.put(e.getKey(), e.getValue().asText()));
        }
    }

    final String idField;
    final Field[] fields;
    final Map<String, Field> byName = new HashMap<>();
    final Map<String, String> lineDetails = new HashMap<>();
    final int strings;
    final int decimals;
    final int timestamps;
    final int integers;
    final int booleans;

    private LineRules(String json) {
        JsonNode root;
        try {
            root = new ObjectMapper().readTree(json);
        } catch (IOException e) {
            throw new UncheckedIOException("statetables: the line rules are not JSON: " + json, e);
        }
        idField = root.get("id").asText();
        JsonNode list = root.get("fields");
        fields = new Field[list.size()];
        int[] counts = new int[Kind.values().length];
        for (int i = 0; i < fields.length; i++) {
            Kind kind = Kind.valueOf(list.get(i).get("kind").asText().toUpperCase());
            fields[i] = new Field(list.get(i), counts[kind.ordinal()]++, i);
            byName.put(fields[i].name, fields[i]);
        }
        strings = counts[Kind.STRING.ordinal()];
        decimals = counts[Kind.DECIMAL.ordinal()];
        timestamps = counts[Kind.TIMESTAMP.ordinal()];
        integers = counts[Kind.INTEGER.ordinal()];
        booleans = counts[Kind.BOOLEAN.ordinal()];
        root.get("line_details").properties().forEach(e -> lineDetails.put(e.getKey(), e.getValue().asText()));
    }

    // Keyed by the rules' text: two streams' batches run side by side in one JVM (the continuous job), so a
    // single "last rules" slot would be parsed again and again as their tasks interleave.
    private static final Map<String, LineRules> PARSED = new java.util.concurrent.ConcurrentHashMap<>();
    // A task passes the same literal's array with every row: recognised by identity, its text is decoded and hashed
    // once per task and thread, not for each row (as a STRING argument, converted to a new String per row, it was:
    // 2 KB of text hashed and compared 100,000 times a batch, half the validator's samples, profiled).
    private static final ThreadLocal<Object[]> LAST = ThreadLocal.withInitial(() -> new Object[2]);

    /** The rules of `json` (UTF-8), parsed once per JVM: every row of a batch passes the same literal. */
    static LineRules of(byte[] json) {
        Object[] last = LAST.get();
        if (last[0] != json) {
            last[1] = PARSED.computeIfAbsent(new String(json, StandardCharsets.UTF_8), LineRules::new);
            last[0] = json;
        }
        return (LineRules) last[1];
    }

}
