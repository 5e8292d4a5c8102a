package statetables.jvm;

import com.fasterxml.jackson.core.JsonFactory;
import com.fasterxml.jackson.core.JsonParser;
import com.fasterxml.jackson.core.JsonToken;
import com.fasterxml.jackson.core.StreamReadConstraints;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.RowFactory;
import org.apache.spark.sql.api.java.UDF3;
import org.apache.spark.unsafe.types.UTF8String;

import java.io.IOException;
import java.math.BigDecimal;
import java.nio.charset.StandardCharsets;

/**
 * `statetables_validate(raw_bytes, rules_json, latest_event_micros)`: one landing line, judged in one pass, by the
 * stream's rules (LineRules: their JSON as UTF-8 bytes, a BINARY literal). The result is the line's first failing
 * rule (reason, field, detail) in the order the contract lists them, or its typed values: strings, DECIMAL(18,2)
 * values, event times (micros), BIGINT values and booleans in the order of their fields, each in the array of its
 * kind.
 *
 * <p>Guarantees: it never throws on any input (a throw would stop the stream on every run); UTF-8 is checked as
 * Spark's is_valid_utf8 checks it, and a kept string whose escapes decode to a lone surrogate is invalid_utf8 too;
 * a document is one JSON value as Spark's parse_json reads it (Jackson's defaults, duplicate keys refused at any
 * depth), with nothing after it; decimals are read exactly from their text, whatever the spelling. Two things are
 * left to SQL, for the rare lines that need them: the name of a wrong JSON type in a detail (`type_of` names the
 * field, or "" for the whole document), and the text of an id that is not a JSON string (`id_needs_variant`), both
 * as Spark's schema_of_variant and variant cast spell them.
 */
public final class ValidateLine implements UDF3<byte[], byte[], Long, Row> {
    private static final long serialVersionUID = 1L;
    // Spark's parse_json is Jackson with its defaults, reading the line inside `[line, "end"]`: one level deeper.
    private static final JsonFactory JSON = JsonFactory.builder()
            .enable(com.fasterxml.jackson.core.StreamReadFeature.STRICT_DUPLICATE_DETECTION)
            .streamReadConstraints(StreamReadConstraints.builder()
                    .maxNestingDepth(StreamReadConstraints.DEFAULT_MAX_DEPTH - 1).build())
            .build();
    private static final long EPOCH = 0L;
    private static final BigDecimal BIGINT_MIN = BigDecimal.valueOf(Long.MIN_VALUE);
    private static final BigDecimal BIGINT_MAX = BigDecimal.valueOf(Long.MAX_VALUE);
    private static final char[] TRIMMED = {' ', '\t', '\n', '\r'};

    @Override
    public Row call(byte[] raw, byte[] rulesJson, Long latestMicros) {
        LineRules rules = LineRules.of(rulesJson);
        if (raw == null || !UTF8String.fromBytes(raw).isValid()) {
            return verdict("invalid_utf8", null, rules.lineDetails.get("invalid_utf8"), null, null, false);
        }
        String text = new String(raw, StandardCharsets.UTF_8);
        Values values = new Values(rules);
        Boolean object;
        try {
            object = values.read(text);
        } catch (IOException | RuntimeException e) {  // any syntax, duplicate key or constraint error
            object = null;
        }
        if (object == null) {
            return verdict("not_json", null, rules.lineDetails.get("not_json"), null, null, false);
        }
        if (!object) {
            return verdict("not_object", null, rules.lineDetails.get("not_object"), "", null, false);
        }
        String recordId = values.idToken == JsonToken.VALUE_STRING ? values.idText : null;
        boolean idNeedsVariant = values.idToken != null && values.idToken != JsonToken.VALUE_STRING
                && values.idToken != JsonToken.VALUE_NULL;
        Object[] strings = new Object[rules.strings];
        Object[] decimals = new Object[rules.decimals];
        Object[] timestamps = new Object[rules.timestamps];
        Object[] integers = new Object[rules.integers];
        Object[] booleans = new Object[rules.booleans];
        DecimalText number = new DecimalText();
        for (LineRules.Field f : rules.fields) {
            JsonToken token = values.tokens[f.position];
            String value = values.texts[f.position];
            boolean missing = token == null || token == JsonToken.VALUE_NULL;
            if (missing) {
                if (f.required) return verdict("missing_field", f.name, f.details.get("missing_field"), null, recordId,
                        idNeedsVariant);
                continue;
            }
            boolean isString = token == JsonToken.VALUE_STRING;
            switch (f.kind) {
                case STRING: {
                    if (!isString) return wrongType(f, recordId, idNeedsVariant);
                    // An escaped lone surrogate (a high half with no low half after it) is valid JSON but no UTF-8
                    // text: stored, it would become '?', and two different keys one.
                    if (hasLoneSurrogate(value)) return verdict("invalid_utf8", f.name, f.details.get("invalid_utf8"),
                            null, recordId, idNeedsVariant);
                    String trimmed = trim(value);
                    if (trimmed.isEmpty()) return verdict("empty_field", f.name, f.details.get("empty_field"), null,
                            recordId, idNeedsVariant);
                    String kept = f.trim ? trimmed : value;
                    if (f.maxLength > 0 && kept.codePointCount(0, kept.length()) > f.maxLength) {
                        return verdict("too_long", f.name, f.details.get("too_long"), null, recordId, idNeedsVariant);
                    }
                    strings[f.slot] = kept;
                    break;
                }
                case DECIMAL:
                case INTEGER: {  // the same JSON types and numeric strings; an integer's digits are plain
                    boolean isNumeric = token == JsonToken.VALUE_NUMBER_INT || token == JsonToken.VALUE_NUMBER_FLOAT;
                    if (!isNumeric && !isString) return wrongType(f, recordId, idNeedsVariant);
                    String digits = isString ? trim(value) : value;
                    if (isString && digits.isEmpty()) return verdict("empty_field", f.name,
                            f.details.get("empty_field"), null, recordId, idNeedsVariant);
                    number.read(digits);
                    if (isString && !number.isNumber) return verdict("wrong_type", f.name,
                            f.details.get("not_a_number"), null, recordId, idNeedsVariant);
                    if (f.kind == LineRules.Kind.INTEGER) {
                        // Whole first: "12.0" or "1e3" is refused as written, so a range is only read from digits.
                        if (!number.plainInteger) return verdict("too_many_decimals", f.name,
                                f.details.get("too_many_decimals"), null, recordId, idNeedsVariant);
                        if (number.below(BIGINT_MIN, true) || number.above(BIGINT_MAX, true)
                                || number.below(f.min, f.minInclusive) || number.above(f.max, f.maxInclusive)) {
                            return verdict("out_of_range", f.name, f.details.get("out_of_range"), null, recordId,
                                    idNeedsVariant);
                        }
                        integers[f.slot] = number.longValue();
                        break;
                    }
                    if (!number.isNumber || number.tooBig || number.below(f.min, f.minInclusive)
                            || number.above(f.max, f.maxInclusive)) {
                        return verdict("out_of_range", f.name, f.details.get("out_of_range"), null, recordId,
                                idNeedsVariant);
                    }
                    if (number.tooPrecise) return verdict("too_many_decimals", f.name,
                            f.details.get("too_many_decimals"), null, recordId, idNeedsVariant);
                    decimals[f.slot] = number.value();
                    break;
                }
                case BOOLEAN: {  // JSON's true and false only: "true" or 1 is a producer's mistake to show
                    if (token != JsonToken.VALUE_TRUE && token != JsonToken.VALUE_FALSE) {
                        return wrongType(f, recordId, idNeedsVariant);
                    }
                    booleans[f.slot] = token == JsonToken.VALUE_TRUE;
                    break;
                }
                default: {  // TIMESTAMP
                    if (!isString) return wrongType(f, recordId, idNeedsVariant);
                    Long micros = IsoTimestamp.micros(value);
                    if (micros == null) return verdict("invalid_timestamp", f.name,
                            f.details.get("invalid_timestamp"), null, recordId, idNeedsVariant);
                    if (micros < EPOCH || micros > latestMicros) return verdict("out_of_range", f.name,
                            f.details.get("out_of_range"), null, recordId, idNeedsVariant);
                    timestamps[f.slot] = micros;
                }
            }
        }
        return RowFactory.create(null, null, null, null, recordId, idNeedsVariant, strings, decimals, timestamps,
                integers, booleans);
    }

    private static Row wrongType(LineRules.Field f, String recordId, boolean idNeedsVariant) {
        return verdict("wrong_type", f.name, f.details.get("wrong_type"), f.name, recordId, idNeedsVariant);
    }

    private static Row verdict(String reason, String field, String detail, String typeOf, String recordId,
                               boolean idNeedsVariant) {
        return RowFactory.create(reason, field, detail, typeOf, recordId, idNeedsVariant, null, null, null, null,
                null);
    }

    /** Whether `s` holds a UTF-16 surrogate that is not half of a pair. */
    static boolean hasLoneSurrogate(String s) {
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (!Character.isSurrogate(c)) continue;
            if (Character.isHighSurrogate(c) && i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
                i++;
                continue;
            }
            return true;
        }
        return false;
    }

    /** Removes JSON's own whitespace at both ends (Spark's trim(s, ' \t\n\r')). */
    static String trim(String s) {
        int start = 0, end = s.length();
        while (start < end && isTrimmed(s.charAt(start))) start++;
        while (end > start && isTrimmed(s.charAt(end - 1))) end--;
        return s.substring(start, end);
    }

    private static boolean isTrimmed(char c) {
        for (char t : TRIMMED) if (c == t) return true;
        return false;
    }

    /** The tokens and texts of the fields (and the id) of one line's top-level object, read in one pass. */
    private static final class Values {
        final LineRules rules;
        final JsonToken[] tokens;
        final String[] texts;
        JsonToken idToken;
        String idText;

        Values(LineRules rules) {
            this.rules = rules;
            tokens = new JsonToken[rules.fields.length];
            texts = new String[rules.fields.length];
        }

        /** Whether the line is one JSON object (true), one other JSON value (false); null when not one value. */
        Boolean read(String text) throws IOException {
            try (JsonParser p = JSON.createParser(text)) {
                JsonToken first = p.nextToken();
                if (first == null) return null;
                if (first != JsonToken.START_OBJECT) {
                    p.skipChildren();
                    return p.nextToken() == null ? Boolean.FALSE : null;
                }
                JsonToken t;
                while ((t = p.nextToken()) == JsonToken.FIELD_NAME) {
                    String name = p.currentName();
                    JsonToken value = p.nextToken();
                    LineRules.Field f = rules.byName.get(name);
                    boolean isId = name.equals(rules.idField);
                    if (value.isScalarValue()) {
                        if (f != null || isId) {
                            String valueText = value == JsonToken.VALUE_NULL ? null : p.getText();
                            if (f != null) {
                                tokens[f.position] = value;
                                texts[f.position] = valueText;
                            }
                            if (isId) {
                                idToken = value;
                                idText = valueText;
                            }
                        }
                    } else {
                        if (f != null) tokens[f.position] = value;
                        if (isId) idToken = value;
                        p.skipChildren();
                    }
                }
                if (t != JsonToken.END_OBJECT) return null;
                return p.nextToken() == null ? Boolean.TRUE : null;
            }
        }
    }
}
