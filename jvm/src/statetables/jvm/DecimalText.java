package statetables.jvm;

import java.math.BigDecimal;
import java.math.RoundingMode;

/**
 * What a decimal field needs to know of a number's text (a JSON number literal as written, or a numeric string
 * trimmed), decided exactly on its digits: no double is ever involved, and an exponent of any length is read
 * without building the number. A value d1..dn x 10^k (trailing zeros folded into k) has n + k integer digits and
 * max(0, -k) decimals. The value fits DECIMAL(18,2) when it has at most 16 integer digits, at most 2 decimals and
 * is at most 9999999999999999.99.
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
    private boolean enormous;
    private String text;

    /** Reads `text`: sign, ASCII digits with an optional point, an optional exponent; nothing else. */
    DecimalText read(String text) {
        this.text = text;
        isNumber = negative = zero = tooBig = tooPrecise = false;
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
            return this;
        }
        long k = exponent - (fracEnd - fracStart) + trailing;
        long integerDigits = significant + k;
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

    /** Whether the value lies below `min` (or at it, when `min` is exclusive). */
    boolean below(BigDecimal min, boolean inclusive) {
        if (min == null) return false;
        if (min.signum() == 0) return negative || (!inclusive && zero);
        if (enormous) return negative;  // an exponent too long for a BigDecimal: its sign decides
        int c = zero ? -min.signum() : new BigDecimal(text).compareTo(min);
        return c < 0 || (!inclusive && c == 0);
    }

    private static boolean isDigit(char c) {
        return c >= '0' && c <= '9';
    }
}
