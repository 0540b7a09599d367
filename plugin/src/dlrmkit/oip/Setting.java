package dlrmkit.oip;

import org.pytorch.serve.util.ConfigManager;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * One of the plugin's config.properties keys: a number >= 0, read (and a bad value warned about)
 * once, not at every readiness probe or worker start: the properties do not change while the
 * server runs.
 */
final class Setting {
    private static final Logger LOG = LoggerFactory.getLogger(Setting.class);

    private final String key;
    private final double defaultValue;
    private final String unit;
    private volatile Double value;

    /** ``unit`` names what the number counts in the warning, e.g. "seconds". */
    Setting(String key, double defaultValue, String unit) {
        this.key = key;
        this.defaultValue = defaultValue;
        this.unit = unit;
    }

    double get() {
        Double v = value;
        if (v == null) {
            v = read();
            value = v;
        }
        return v;
    }

    private double read() {
        String v = ConfigManager.getInstance().getProperty(key, null);
        if (v == null || v.isBlank()) {
            return defaultValue;
        }
        try {
            double s = Double.parseDouble(v.trim());
            if (s >= 0 && !Double.isNaN(s) && !Double.isInfinite(s)) {
                return s;
            }
        } catch (NumberFormatException e) {
            // said below
        }
        LOG.warn("{}={}: not a number of {} >= 0 (e.g. {}={}); using {}", key, v, unit, key, (long) defaultValue, defaultValue);
        return defaultValue;
    }
}
