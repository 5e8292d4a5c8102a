package statetables.jvm;

import org.apache.spark.sql.api.java.UDF1;

/**
 * A unit's bytes as its lines' bytes, cut at each newline; the newline that ends the unit is a terminator (no empty
 * last line), as pipelines/ingest/landing.py `split_lines` says. Bytes, not text: a line keeps its bytes exactly,
 * valid UTF-8 or not.
 */
public final class SplitLines implements UDF1<byte[], byte[][]> {
    private static final long serialVersionUID = 1L;

    @Override
    public byte[][] call(byte[] content) {
        if (content == null) {
            return null;
        }
        if (content.length == 0) {
            return new byte[0][];
        }
        int n = content.length, count = 1;
        for (int i = 0; i < n; i++) {
            if (content[i] == '\n') {
                count++;
            }
        }
        boolean terminated = n > 0 && content[n - 1] == '\n';
        byte[][] lines = new byte[terminated ? count - 1 : count][];
        int start = 0, k = 0;
        for (int i = 0; i < n; i++) {
            if (content[i] == '\n') {
                lines[k++] = java.util.Arrays.copyOfRange(content, start, i);
                start = i + 1;
            }
        }
        if (!terminated) {
            lines[k] = java.util.Arrays.copyOfRange(content, start, n);
        }
        return lines;
    }
}
