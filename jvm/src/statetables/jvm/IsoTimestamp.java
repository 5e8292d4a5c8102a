package statetables.jvm;

import org.apache.spark.sql.catalyst.util.DateTimeUtils;
import org.apache.spark.unsafe.types.UTF8String;
import scala.Option;

import java.time.ZoneOffset;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The contract's event time: ISO-8601 with an explicit offset or Z, seconds optional, at most 6 fraction digits.
 * The shape is checked here; the instant is read by Spark's own string-to-timestamp cast, so a calendar date, an
 * hour or an offset means exactly what it means everywhere else in Spark.
 */
final class IsoTimestamp {
    private static final Pattern ISO = Pattern.compile(
            "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\\.[0-9]{1,6})?)?(Z|[+-][0-9]{2}:?[0-9]{2})");

    private IsoTimestamp() {
    }

    /** Microseconds since the epoch, or null when the text is not such a timestamp. */
    static Long micros(String text) {
        Matcher m = ISO.matcher(text);
        if (!m.matches()) return null;
        // ISO-8601 allows leaving out the seconds; Spark's cast does not.
        String full = m.group(1) == null ? text.substring(0, 16) + ":00" + text.substring(16) : text;
        Option<Object> parsed = DateTimeUtils.stringToTimestamp(UTF8String.fromString(full), ZoneOffset.UTC);
        return parsed.isDefined() ? (Long) parsed.get() : null;
    }
}
