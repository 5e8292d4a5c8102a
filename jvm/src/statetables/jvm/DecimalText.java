package statetables.jvm;

import java.math.BigDecimal;
import java.math.RoundingMode;

/**
 * What a decimal or integer field needs to know of a number's text (a JSON number literal as written, or a numeric
 * string trimmed), decided exactly on its digits: no double is ever involved, and an exponent of any length is read
 * without building the number. A value d1..dn x 10^k (trailing zeros folded into k) has n + k integer digits and
 * max(0, -k) decimals. The value fits DECIMAL(18,2) when it has at most 16 integer digits, at most 2 decimals and
 * is at most 9999999999999999.99. An integer field takes only a plain integer (sign and digits) within its bounds.
 */
final class DecimalText {
    static final int MAX_INTEGER_DIGITS = 16;
    static final int MAX_DECIMALS = 2;
    static final BigDecimal MAX_VALUE = new BigDecimal("9999999999999999.99");

    boolean isNumber;
    boolean negative;
    boolean zero;
    boolean tooBig;
    boolean tooPrecise;
    boolean plainInteger;  // a sign and digits only: no point, no exponent
    private boolean enormous;
    private long integerDigits;  // of a non-zero value: n + k above; Long.MAX_VALUE/MIN_VALUE when enormous
    private String text;

    /** Reads `text`: sign, ASCII digits with an optional point, an optional exponent; nothing else. */
    DecimalText read(String text) {
        this.text = text;
        isNumber = negative = zero = tooBig = tooPrecise = plainInteger = false;
        int n = text.length(), i = 0;
        boolean minus = false;
        if (i < n && (text.charAt(i) == '+' || text.charAt(i) == '-')) {
            minus = text.charAt(i) == '-';
            i++;
        }
        int wholeStart = i;
        while (i < n && isDigit(text.charAt(i))) i++;
        int wholeEnd = i, fracStart = i, fracEnd = i;
        if (i < n && text.charAt(i) == '.') {
            fracStart = ++i;
            while (i < n && isDigit(text.charAt(i))) i++;
            fracEnd = i;
        }
        int digitCount = (wholeEnd - wholeStart) + (fracEnd - fracStart);
        boolean expNegative = false;
        long exponent = 0;
        enormous = false;
        if (i < n && (text.charAt(i) == 'e' || text.charAt(i) == 'E')) {
            i++;
            if (i < n && (text.charAt(i) == '+' || text.charAt(i) == '-')) {
                expNegative = text.charAt(i) == '-';
                i++;
            }
            int expStart = i;
            while (i < n && isDigit(text.charAt(i))) i++;
            if (i == expStart) return this;  // an exponent needs digits
            int first = expStart;
            while (first < i - 1 && text.charAt(first) == '0') first++;
            if (i - first > 9) {
                enormous = true;  // beyond any DECIMAL(18,2) either way; never built as a number
            } else {
                exponent = Long.parseLong(text, first, i, 10);
                if (expNegative) exponent = -exponent;
            }
        }
        if (i != n || digitCount == 0) return this;
        isNumber = true;
        plainInteger = wholeEnd == n;
        // significant digits: the digits without leading and trailing zeros
        int trailing = 0, significant = 0;
        boolean seenNonZero = false;
        int zerosSinceNonZero = 0;
        for (int j = wholeStart; j < fracEnd; j++) {
            char c = text.charAt(j);
            if (c == '.') continue;
            if (c != '0') {
                significant += seenNonZero ? zerosSinceNonZero + 1 : 1;
                seenNonZero = true;
                zerosSinceNonZero = 0;
            } else if (seenNonZero) {
                zerosSinceNonZero++;
            }
        }
        trailing = seenNonZero ? zerosSinceNonZero : digitCount;
        zero = !seenNonZero;
        if (zero) return this;
        negative = minus;
        if (enormous) {
            tooBig = !expNegative;
            tooPrecise = expNegative;
            integerDigits = expNegative ? Long.MIN_VALUE : Long.MAX_VALUE;
            return this;
        }
        long k = exponent - (fracEnd - fracStart) + trailing;
        integerDigits = significant + k;
        tooBig = integerDigits > MAX_INTEGER_DIGITS
                || (integerDigits == MAX_INTEGER_DIGITS && new BigDecimal(text).abs().compareTo(MAX_VALUE) > 0);
        tooPrecise = -k > MAX_DECIMALS;
        return this;
    }

    /** The value as DECIMAL(18,2); only for a number that is neither too big nor too precise. */
    BigDecimal value() {
        if (zero) return BigDecimal.ZERO.setScale(MAX_DECIMALS);
        return new BigDecimal(text).setScale(MAX_DECIMALS, RoundingMode.UNNECESSARY);
    }

    /** The value as BIGINT; only for a plain integer within BIGINT's range. */
    long longValue() {
        return Long.parseLong(text);  // takes the sign, "-0" and leading zeros as the digits mean them
    }

    /** Whether the value lies below `min` (or at it, when `min` is exclusive); no bound (null): never. */
    boolean below(BigDecimal min, boolean inclusive) {
        if (min == null) return false;
        int c = compareTo(min);
        return c < 0 || (!inclusive && c == 0);
    }

    /** Whether the value lies above `max` (or at it, when `max` is exclusive); no bound (null): never. */
    boolean above(BigDecimal max, boolean inclusive) {
        if (max == null) return false;
        int c = compareTo(max);
        return c > 0 || (!inclusive && c == 0);
    }

    /**
     * The sign of value - bound. Signs decide first, then the count of integer digits, so the text is built as a
     * BigDecimal only when both have as many: a numeric string can be megabytes of digits, and an enormous exponent
     * cannot be built at all (its magnitude lies beyond or beneath any bound's).
     */
    private int compareTo(BigDecimal bound) {
        int sign = zero ? 0 : negative ? -1 : 1;
        if (sign != bound.signum() || sign == 0) return Integer.compare(sign, bound.signum());
        long boundDigits = (long) bound.precision() - bound.scale();
        int magnitude = integerDigits != boundDigits ? Long.compare(integerDigits, boundDigits)
                : new BigDecimal(text).abs().compareTo(bound.abs());
        return sign * magnitude;
    }

    private static boolean isDigit(char c) {
        return c >= '0' && c <= '9';
    }
}
